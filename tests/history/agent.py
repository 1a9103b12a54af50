#!/usr/bin/env python3
"""The history run's agent (issue 42): what every agent process of the run is, and its
side of the record.

Every process appends JSON lines to its own file in ``$HISTORY_AGENT_LOG`` (one file per
process, each line fsynced before the agent acts on it), so the record says what really
happened on the machine whatever the worker or the service say:

- ``{"ev": "start", "op", "task", "prompt", "pid", "t"}`` once, first thing;
- ``{"ev": "message", "text", "pid", "op", "t"}`` for every user line it reads in a live
  conversation (Claude Code's streaming-input mode, as ``bench/stream_agent.py``);
- ``{"ev": "acted", "decision", "task", "t"}`` after asking through the run's
  ``PermissionRequest`` hook (``[[ask]]`` in the prompt, a profile with
  ``approvals = "ask"``): the real hook (``--settings``) is run with a request on stdin
  and the behaviour it printed (``allow``, ``deny``, or null when it printed nothing) is
  what the agent acts on.

Shapes, from argv: ``agent.py PROMPT`` (a plain profile: text out, exit status);
``... -p ... -- PROMPT`` (the ``claude`` preset headless: stream-json out, one
``result``); ``... --input-format stream-json ...`` (the ``claude`` preset live: one turn
per user line, a line read during a turn joins it, a ``control_request`` interrupt ends
the turn at once, EOF ends the run; with ``--replay-user-messages`` each user line is
echoed as it is read, ``isReplay``, as Claude Code does when it takes one: without the
echo the worker could not tell a line that joined a turn from one that opened its own).
Directives in a prompt or message: ``[[sleep:S]]`` (seconds of work), ``[[exit:N]]``,
``[[commit:NAME]]`` (write and commit a file in the folder), ``[[ask]]``.
"""
import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
import uuid

LOG_DIR = os.environ.get("HISTORY_AGENT_LOG", "")
OP = os.environ.get("RUNSTEAD_OPERATION_ID")
_log = open(os.path.join(LOG_DIR, f"{os.getpid()}-{uuid.uuid4().hex[:6]}.jsonl"), "a") if LOG_DIR else None


def note(ev: str, **fields) -> None:
    if _log is None:
        return
    _log.write(json.dumps({"ev": ev, "pid": os.getpid(), "op": OP, "t": time.time(), **fields}) + "\n")
    _log.flush()
    os.fsync(_log.fileno())


def directive(text: str, name: str, default=None):
    found = re.search(r"\[\[" + name + r"(?::(.*?))?\]\]", text)
    return default if found is None else (found.group(1) or "")


def out(obj) -> None:
    print(json.dumps(obj), flush=True)


def ask(argv: list[str], prompt: str) -> None:
    """Run the ``PermissionRequest`` hook of ``--settings`` as Claude Code does."""
    settings = json.loads(argv[argv.index("--settings") + 1])
    command = settings["hooks"]["PermissionRequest"][0]["hooks"][0]["command"]
    request = {"session_id": os.environ.get("RUNSTEAD_TASK_ID"), "prompt_id": "p1", "hook_event_name": "PermissionRequest",
               "tool_name": "Bash", "tool_input": {"command": f"echo {prompt[:40]}"}, "cwd": os.getcwd()}
    done = subprocess.run(command, shell=True, input=json.dumps(request), capture_output=True, text=True, timeout=120)
    decision = None
    if done.stdout.strip():
        decision = json.loads(done.stdout)["hookSpecificOutput"]["decision"]["behavior"]
    note("acted", decision=decision, task=os.environ.get("RUNSTEAD_TASK_ID"))


def work(prompt: str) -> None:
    name = directive(prompt, "commit")
    if name:
        with open(f"{name}.txt", "w") as f:
            f.write(name + "\n")
        identity = ["-c", "user.name=agent", "-c", "user.email=agent@example.com"]
        subprocess.run(["git", "add", "-A"], check=True)
        subprocess.run(["git", *identity, "commit", "-q", "-m", name], check=True)
    end = time.monotonic() + float(directive(prompt, "sleep", "0") or 0)
    while time.monotonic() < end:
        print("working", flush=True)
        time.sleep(min(0.2, max(0.0, end - time.monotonic())))


def headless(argv: list[str], prompt: str, claude: bool) -> int:
    session = str(uuid.uuid4())
    if claude:
        out({"type": "system", "subtype": "init", "session_id": session})
    if directive(prompt, "ask") is not None and "--settings" in argv:
        ask(argv, prompt)
    work(prompt)
    code = int(directive(prompt, "exit", "0") or 0)
    if claude:
        out({"type": "result", "subtype": "success", "is_error": False, "result": "ok", "session_id": session,
             "num_turns": 1})
    else:
        print("agent done", flush=True)
    return code


def live(replay: bool) -> int:
    session = str(uuid.uuid4())
    out({"type": "system", "subtype": "init", "session_id": session})
    lines: queue.Queue = queue.Queue()

    def read():
        for line in sys.stdin:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    turn_end = None  # monotonic deadline of the open turn
    result = {"type": "result", "subtype": "success", "is_error": False, "result": "ok", "session_id": session,
              "num_turns": 1}
    while True:
        if turn_end is None:
            line = lines.get()
        else:
            try:
                line = lines.get(timeout=max(0.0, turn_end - time.monotonic()))
            except queue.Empty:
                out(result)
                turn_end = None
                continue
        if line is None:  # EOF: the owner ended the conversation; the open turn finishes first
            if turn_end is not None:
                time.sleep(max(0.0, turn_end - time.monotonic()))
                out(result)
            return 0
        event = json.loads(line)
        if event.get("type") == "user":
            text = event["message"]["content"]
            note("message", text=text)
            if replay:  # Claude Code echoes a user line as it takes it (C9's ``consumed``)
                out({**event, "session_id": session, "parent_tool_use_id": None,
                     "uuid": event.get("uuid") or str(uuid.uuid4()), "isReplay": True})
            if turn_end is None:
                turn_end = time.monotonic() + float(directive(text, "sleep", "0") or 0)
        elif event.get("type") == "control_request":
            out({"type": "control_response", "response": {"subtype": "success", "request_id": event.get("request_id")}})
            if turn_end is not None:
                out({**result, "subtype": "error_during_execution", "is_error": True})
                turn_end = None


def main() -> int:
    argv = sys.argv[1:]
    if "--input-format" in argv:
        note("start", task=os.environ.get("RUNSTEAD_TASK_ID"), prompt=None)
        return live(replay="--replay-user-messages" in argv)
    prompt = argv[argv.index("--") + 1] if "--" in argv else (argv[0] if argv else "")
    note("start", task=os.environ.get("RUNSTEAD_TASK_ID"), prompt=prompt)
    return headless(argv, prompt, claude="-p" in argv)


if __name__ == "__main__":
    sys.exit(main())
