#!/usr/bin/env python3
"""A stand-in for Claude Code's streaming-input mode (docs/claude-stream-input.md), for
``bench/conversation.py`` only: one ``system/init`` line, then for every stream-json user
line read on stdin the moment it was read (``time.time()``, wall seconds, with its text)
appended to ``$BENCH_ARRIVALS/<pid>.jsonl`` and one ``result`` line at once; EOF exits 0.
With ``--replay-user-messages`` (the live argv has it, SPEC C9) each user line is echoed
as it is read (``isReplay``, its ``uuid`` kept), as Claude Code does when it takes a line.
A prompt containing ``[[hold]]`` opens a turn that runs until EOF: the lines after it are
taken into that turn (echoed, no ``result`` of their own), as steers at a tool boundary.
A real Claude Code per conversation (a Node.js process of ~150 MB) times 100 does not fit
the bench machine; what is measured is RunStead's path to the agent's stdin, not the CLI."""
import json
import os
import sys
import time
import uuid

arrivals = open(os.path.join(os.environ["BENCH_ARRIVALS"], f"{os.getpid()}.jsonl"), "a", buffering=1)
session_id = str(uuid.uuid4())
RESULT = {"type": "result", "subtype": "success", "is_error": False, "result": "ok", "session_id": session_id,
          "num_turns": 1}
replay, holding = "--replay-user-messages" in sys.argv[1:], False
print(json.dumps({"type": "system", "subtype": "init", "session_id": session_id}), flush=True)
for line in sys.stdin:
    at = time.time()
    event = json.loads(line)
    if event.get("type") == "user":
        arrivals.write(json.dumps({"t": at, "text": event["message"]["content"]}) + "\n")
        if replay:
            print(json.dumps({**event, "session_id": session_id, "parent_tool_use_id": None,
                              "uuid": event.get("uuid") or str(uuid.uuid4()), "isReplay": True}), flush=True)
        holding = holding or "[[hold]]" in event["message"]["content"]
        if not holding:
            print(json.dumps(RESULT), flush=True)
if holding:
    print(json.dumps(RESULT), flush=True)
