#!/usr/bin/env python3
"""A stand-in agent CLI for argv tests: writes ``{"argv": [...], "stdin": "..."}`` (its
arguments after the program name, and everything it read on stdin) as JSON to the file
named by ``RECORD_ARGV``, then exits 0. It interprets nothing, so what it records is
exactly what the worker passed."""
import json
import os
import sys

data = sys.stdin.buffer.read() if not sys.stdin.isatty() else b""
with open(os.environ["RECORD_ARGV"], "w") as f:
    json.dump({"argv": sys.argv[1:], "stdin": data.decode("utf-8", errors="surrogateescape")}, f)
