"""What the worker learns about a running agent besides its exit status (SPEC G2-G5).

``AgentObserver`` follows the agent's output file (``op_dir/output.log``, where the
launcher sends stdout and stderr) from where it last read, feeds each line to the
profile's parser (``parsers``), records git evidence at spawn and at the end
(``git_evidence``), and gives:

- ``progress(output_tail)``: the G4 body parts ``{"output_tail", "last_message", "usage"}``;
- ``final_extras()``: the G3/G5 keys of the final facts ``{"agent_result", "usage",
  "agent_session_id", "evidence": {"git"?}}``.

The git start is kept in ``op_dir/git_start.json`` so that a restarted worker (X3) can
still report evidence, and ``recovered_extras`` re-reads the whole output file for the
parsed figures. Standard library only; memory bounded by the parser's bounds and one
read chunk.
"""
from __future__ import annotations

import json
import os

from . import git_evidence
from .parsers import TextParser, make_parser

READ_CHUNK = 256 * 1024
MAX_READ_PER_POLL = 8 * 1024 * 1024


class AgentObserver:
    """One run's parser, output follower and git evidence."""

    def __init__(self, *, parser: str, op_dir: str, folder: str):
        self.parser: TextParser = make_parser(parser)
        self.op_dir = op_dir
        self.folder = folder
        self.path = os.path.join(op_dir, "output.log")
        self.offset = 0
        self.git_start: dict | None = None
        self.git_end: dict | None = None

    # --- git (G5) ------------------------------------------------------------------------

    def record_git_start(self) -> None:
        """At spawn: ``HEAD`` and the dirty count, also written to ``git_start.json``."""
        self.git_start = git_evidence.git_start(self.folder)
        _write_json(os.path.join(self.op_dir, "git_start.json"), {"git": self.git_start})

    def record_git_end(self) -> None:
        if self.git_start is not None:
            self.git_end = git_evidence.git_end(self.folder, self.git_start)

    # --- output (G2) ---------------------------------------------------------------------

    def poll(self, limit: int = MAX_READ_PER_POLL) -> bool:
        """Feed what the agent wrote since the last poll (at most ``limit`` bytes, so a
        flood never stalls the caller). True when the parsed figures changed."""
        before = self.parser.version
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                read = 0
                while read < limit:
                    data = f.read(READ_CHUNK)
                    if not data:
                        break
                    self.parser.feed(data)
                    read += len(data)
                    self.offset += len(data)
        except OSError:
            return False
        return self.parser.version != before

    def finish(self) -> None:
        """The agent ended: read the rest and let the parser close its last line."""
        while True:
            offset = self.offset
            self.poll()
            if self.offset == offset:
                break
        self.parser.close()

    # --- answers -------------------------------------------------------------------------

    def progress(self, output_tail: str) -> dict:
        """G4 body parts: ``{"output_tail", "last_message", "usage"}``."""
        return {"output_tail": output_tail, **self.parser.progress()}

    def final_extras(self) -> dict:
        """G3/G5 keys of the final facts (H): agent_result, usage, agent_session_id, evidence."""
        facts = self.parser.facts()
        return {
            "agent_result": facts["agent_result"],
            "usage": facts["usage"],
            "agent_session_id": facts["agent_session_id"],
            "evidence": {"git": self.git_end} if self.git_end is not None else {},
        }


def recovered_extras(*, parser: str, op_dir: str, folder: str | None) -> dict:
    """X3: the same keys for an operation a previous worker ran, from its output file and
    the git start it recorded (no git start recorded -> no git evidence)."""
    observer = AgentObserver(parser=parser, op_dir=op_dir, folder=folder or "/")
    observer.finish()
    saved = _read_json(os.path.join(op_dir, "git_start.json")) or {}
    if folder and saved.get("git") is not None:
        observer.git_start = saved["git"]
        observer.record_git_end()
    return observer.final_extras()


def _write_json(path: str, data: dict) -> None:
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except OSError:
        pass


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            value = json.load(f)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None
