#!/usr/bin/env python3
"""A test agent for the worker's real-process tests. Behaviour from the environment:

- ``AGENT_STARTS``: a file; one line is appended on every start (count = runs).
- ``AGENT_PIDS``: a file; every process of the agent appends ``<pid> <role>`` when it
  starts, so a test can check afterwards that none survives.
- ``AGENT_SLEEP_S`` (default 0): how long the main process sleeps before exiting.
- ``AGENT_EXIT`` (default 0): its exit code.
- ``AGENT_CHILDREN``: ``tree`` (a child and a grandchild, same group), ``setsid`` (a
  child that calls setsid() and so leaves the group), ``forks`` (keeps forking sleeping
  children, at most ``AGENT_FORKS`` (default 150, <= 200), half of them setsid()).
- ``AGENT_IGNORE_TERM=1``: the main process ignores SIGTERM.
- ``AGENT_ENV_DUMP``: a file; the main process writes its whole environment there as JSON
  (W5: what an agent can see).
- ``AGENT_SPANS``: a file; the main process appends ``<start wall> <end wall> <cwd>``
  when it ends by itself (G7: runs that overlap in time).
- In the prompt (G7: work in a repository): ``[[write:PATH:TEXT]]`` writes TEXT (``\n``
  for a line break) to PATH in the working directory, ``[[commit:MESSAGE]]`` commits
  everything with git (author "agent"); in the order they appear, at the start.

It prints a line per second so output tails have something to show. Argument 1 (the
prompt) is echoed.
"""
import os
import re
import signal
import subprocess
import sys
import time

DIRECTIVE = re.compile(r"\[\[(write|commit):(.*?)\]\]", re.S)


def note(path_var, text):
    path = os.environ.get(path_var)
    if path:
        with open(path, "a") as f:
            f.write(text + "\n")
            f.flush()
            os.fsync(f.fileno())


def sleeper(role, seconds=60.0, new_session=False):
    pid = os.fork()
    if pid:
        return pid
    try:
        if new_session:
            os.setsid()
        note("AGENT_PIDS", f"{os.getpid()} {role}")
        time.sleep(seconds)  # lives until a stop ends it: what the tests' stops must find
    finally:
        os._exit(0)


def work_in_repository(prompt):
    for kind, arg in DIRECTIVE.findall(prompt):
        if kind == "write":
            path, _, text = arg.partition(":")
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            with open(path, "w") as f:
                f.write(text.replace("\\n", "\n"))
        else:
            identity = ["-c", "user.name=agent", "-c", "user.email=agent@example.com"]
            subprocess.run(["git", "add", "-A"], check=True)
            subprocess.run(["git", *identity, "commit", "-q", "-m", arg], check=True)


def main():
    started = time.time()
    note("AGENT_STARTS", f"start {os.getpid()} {started}")
    note("AGENT_PIDS", f"{os.getpid()} main")
    if os.environ.get("AGENT_ENV_DUMP"):
        import json

        with open(os.environ["AGENT_ENV_DUMP"], "w") as f:
            json.dump(dict(os.environ), f)
    print(f"agent started, prompt: {sys.argv[1] if len(sys.argv) > 1 else ''}", flush=True)
    work_in_repository(sys.argv[1] if len(sys.argv) > 1 else "")
    if os.environ.get("AGENT_IGNORE_TERM") == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    mode = os.environ.get("AGENT_CHILDREN", "")
    if mode == "tree":
        pid = os.fork()
        if pid == 0:
            note("AGENT_PIDS", f"{os.getpid()} child")
            sleeper("grandchild")
            time.sleep(60)  # the child, likewise alive until stopped
            os._exit(0)
    elif mode == "setsid":
        sleeper("escaped", new_session=True)
    elif mode == "forks":
        limit = min(200, int(os.environ.get("AGENT_FORKS", "150")))
        for i in range(limit):
            sleeper(f"fork{i}", new_session=(i % 2 == 1))
            time.sleep(0.005)  # keeps forking for a while, so a stop meets it mid-way
    end = time.monotonic() + float(os.environ.get("AGENT_SLEEP_S", "0"))
    n = 0
    while time.monotonic() < end:
        n += 1
        print(f"working {n}", flush=True)
        time.sleep(min(1.0, max(0.0, end - time.monotonic())))  # the agent's work: AGENT_SLEEP_S
    print("agent done", flush=True)
    note("AGENT_SPANS", f"{started} {time.time()} {os.getcwd()}")
    sys.exit(int(os.environ.get("AGENT_EXIT", "0")))


if __name__ == "__main__":
    main()
