#!/usr/bin/env python3
"""The demo agent profile: real work in the demo repository, slowly enough to watch.

Usage: demo_agent.py PROMPT. Runs the repository's unit tests ROUNDS times with a pause
between rounds (about 10 s in all), records the prompt in the repository's NOTES.md, and
exits with the status of the last test run.
"""
import os
import subprocess
import sys
import time

ROUNDS = int(os.environ.get("DEMO_ROUNDS", "4"))
PAUSE_S = float(os.environ.get("DEMO_PAUSE_S", "3"))


def main() -> int:
    prompt = sys.argv[1] if len(sys.argv) > 1 else ""
    print(f"agent: working on {prompt!r} in {os.getcwd()}", flush=True)
    status = 0
    for round_no in range(1, ROUNDS + 1):
        print(f"agent: test round {round_no}/{ROUNDS}", flush=True)
        status = subprocess.run([sys.executable, "-m", "unittest", "-v"], check=False).returncode
        if round_no < ROUNDS:
            time.sleep(PAUSE_S)
    with open("NOTES.md", "a", encoding="utf-8") as notes:
        notes.write(f"- {time.strftime('%Y-%m-%d %H:%M:%S')} {prompt}: tests exit {status}\n")
    print(f"agent: done, tests exit {status}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
