#!/usr/bin/env python3
"""A stand-in hook command that records what an agent CLI sends its hooks:
``record_hook.py OUT_FILE AGENT [PAYLOAD]`` appends one JSON line
``{"agent", "argv", "stdin"}`` to OUT_FILE (``stdin`` parsed as JSON when it is JSON)
and exits 0, printing nothing (tests/record_hook_fixtures.py)."""
import json
import os
import sys

out, agent, *rest = sys.argv[1:]
data = sys.stdin.buffer.read() if not sys.stdin.isatty() else b""
try:
    stdin = json.loads(data) if data.strip() else None
except ValueError:
    stdin = data.decode("utf-8", errors="replace")
with open(out, "a") as f:
    f.write(json.dumps({"agent": agent, "argv": rest, "stdin": stdin}) + "\n")
    f.flush()
    os.fsync(f.fileno())
