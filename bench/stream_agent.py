#!/usr/bin/env python3
"""A stand-in for Claude Code's streaming-input mode (docs/claude-stream-input.md), for
``bench/conversation.py`` only: one ``system/init`` line, then for every stream-json user
line read on stdin the moment it was read (``time.time()``, wall seconds, with its text)
appended to ``$BENCH_ARRIVALS/<pid>.jsonl`` and one ``result`` line at once; EOF exits 0.
A real Claude Code per conversation (a Node.js process of ~150 MB) times 100 does not fit
the bench machine; what is measured is RunStead's path to the agent's stdin, not the CLI."""
import json
import os
import sys
import time
import uuid

arrivals = open(os.path.join(os.environ["BENCH_ARRIVALS"], f"{os.getpid()}.jsonl"), "a", buffering=1)
session_id = str(uuid.uuid4())
print(json.dumps({"type": "system", "subtype": "init", "session_id": session_id}), flush=True)
for line in sys.stdin:
    at = time.time()
    event = json.loads(line)
    if event.get("type") == "user":
        arrivals.write(json.dumps({"t": at, "text": event["message"]["content"]}) + "\n")
        print(json.dumps({"type": "result", "subtype": "success", "is_error": False, "result": "ok",
                          "session_id": session_id, "num_turns": 1}), flush=True)
