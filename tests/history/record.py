"""The record of a history run: JSON lines, appended, flushed per line. No Django.

Line types (``type``):

- ``op``: one client operation, written when it completes: ``id``, ``client``, ``f`` (what
  it is: ``submit``, ``read``, ``cancel``, ``revoke``, ``grant``, ``unpair``, ``repair``,
  ``decide``, ``integrate``, ``message``, ``messages``, ``interrupt``, ``end``,
  ``approvals``), ``method``, ``path``, ``key`` (Idempotency-Key or null), ``json`` (the
  body sent), ``args`` (what the checker needs to know of it, e.g. a grant's machine and
  path), ``t0``/``t1`` (``time.time()`` at invocation and completion, seconds), ``status``
  (null: no answer, the operation is indeterminate), ``body`` (the answer's bytes as text)
  and ``replayed`` (the ``Idempotent-Replayed`` header);
- ``fault``: ``what``, ``t0``, ``t1``, ``detail``;
- ``agent``: a line of an agent's own log (``tests/history/agent.py``): ``ev`` ``start``,
  ``message`` or ``acted``, with ``pid``, ``op``, ``t`` and ``proc`` (its file: one per
  process, so a pid the system reused in a long run is not taken for the same process);
- ``repo``: ``machine``, ``subjects``: the commit subjects of a repository's base branch
  at the end of the run (G7: what merges left);
- ``run``: the run's parameters and figures.

All times are one machine's wall clock (client, agents and service share it).
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path


class Recorder:
    """Appends record lines to ``path``; thread-safe; ids count from 1."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._file = open(self.path, "a")
        self._lock = threading.Lock()
        self._next = 0

    def new_id(self) -> int:
        with self._lock:
            self._next += 1
            return self._next

    def write(self, line: dict) -> None:
        text = json.dumps(line, separators=(",", ":"))
        with self._lock:
            self._file.write(text + "\n")
            self._file.flush()

    def op(self, **fields) -> dict:
        line = {"type": "op", **fields}
        self.write(line)
        return line

    def fault(self, what: str, t0: float, t1: float | None = None, **detail) -> None:
        self.write({"type": "fault", "what": what, "t0": t0, "t1": t1 if t1 is not None else time.time(),
                    "detail": detail})

    def agent_logs(self, directory: Path) -> int:
        """Copy every agent's own log lines (one file per process) into the record, in
        file order; how many."""
        count = 0
        for file in sorted(Path(directory).glob("*.jsonl")):
            for raw in file.read_text().splitlines():
                try:
                    line = json.loads(raw)
                except ValueError:
                    continue  # a line cut short by a kill -9 of its agent
                self.write({"type": "agent", "proc": file.stem, **line})
                count += 1
        return count

    def close(self) -> None:
        with self._lock:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()


def load(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
