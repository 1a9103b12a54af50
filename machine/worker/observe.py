"""What the worker learns about a running agent besides its exit status (SPEC G2-G5).

``AgentObserver`` follows the agent's output file (``op_dir/output.log``, where the
launcher sends stdout and stderr) from where it last read, feeds each line to the
profile's parser (``parsers``), and at the end the agent's own run record where its
preset names one (aider's analytics log), records git evidence at spawn and at the end
(``git_evidence``), and gives:

- ``progress(output_tail)``: the G4 body parts ``{"output_tail", "last_message", "usage"}``,
  and ``entries_since(n)``: the transcript entries numbered above ``n`` (G4);
- ``final_extras(confirmed_n)``: the G3/G5 keys of the final facts ``{"agent_result",
  "usage", "agent_session_id", "evidence": {"git"?}, "entries"}`` (G7: with the
  worktree's branch, base, files and diff for a worktree task); ``entries`` are the last
  ``ENTRIES_PER_POST`` entries above ``confirmed_n`` (the highest the service confirmed
  through progress), so the end of the transcript, which no progress post may have
  carried, reaches the service with the final receipt (durably, exactly once).

The git start is kept in ``op_dir/git_start.json`` so that a restarted worker (X3) can
still report evidence, and ``recovered_extras`` re-reads the whole output file for the
parsed figures. Standard library only; memory bounded by the parser's bounds and one
read chunk.
"""
from __future__ import annotations

import json
import os

from machine.files import write_atomic
from machine.protocol import ENTRIES_PER_POST

from . import git_evidence, worktrees
from .parsers import TextParser, make_parser

READ_CHUNK = 256 * 1024
MAX_READ_PER_POLL = 8 * 1024 * 1024


class AgentObserver:
    """One run's parser, output follower and git evidence."""

    def __init__(self, *, parser: str, op_dir: str, folder: str, worktree: dict | None = None,
                 prompt: str | None = None, record: str | None = None):
        self.parser: TextParser = make_parser(parser, prompt)
        self.op_dir = op_dir
        self.folder = folder
        self.worktree = worktree  # G7: worktrees.plan of a worktree task (folder is inside it)
        self.record = record  # the agent's own run record (a preset's ``record``), read at the end
        self.path = os.path.join(op_dir, "output.log")
        self.offset = 0
        self.git_start: dict | None = None
        self.git_end: dict | None = None

    # --- git (G5) ------------------------------------------------------------------------

    def record_git_start(self) -> None:
        """At spawn: ``HEAD`` and the dirty count, also written to ``git_start.json``. A
        worktree task starts clean at its base commit (its worktree is made later); a
        follow-up in the worktree of the task it follows (G8) at the branch's head then."""
        if self.worktree is not None:
            self.git_start = {"start_head": self.worktree.get("start") or self.worktree["base"], "start_dirty": 0}
        else:
            self.git_start = git_evidence.git_start(self.folder)
        _write_json(os.path.join(self.op_dir, "git_start.json"), {"git": self.git_start})

    def resume_git_start(self) -> None:
        """An adopted run (``Runner.adopt``): the git start its first worker recorded."""
        saved = _read_json(os.path.join(self.op_dir, "git_start.json")) or {}
        self.git_start = saved.get("git")

    def record_git_end(self) -> None:
        """At the end: G5 evidence; for a worktree task, first what the agent left
        uncommitted becomes a commit on its branch, then G7's branch, base, files and diff."""
        if self.git_start is None:
            return
        if self.worktree is not None:
            if not os.path.isdir(self.worktree["path"]):
                return
            worktrees.commit_leftovers(self.worktree, task_id=self.worktree.get("task_id", ""))
        self.git_end = git_evidence.git_end(self.folder, self.git_start)
        if self.git_end is not None and self.worktree is not None:
            self.git_end.update(worktrees.evidence(self.worktree))

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
        """The agent ended: read the rest and let the parser close its last line, then
        hand it the agent's run record, if it wrote one (at most ``MAX_READ_PER_POLL``)."""
        while True:
            offset = self.offset
            self.poll()
            if self.offset == offset:
                break
        self.parser.close()
        if self.record:
            try:
                with open(self.record, "rb") as f:
                    self.parser.feed_record(f.read(MAX_READ_PER_POLL))
            except OSError:
                pass  # never written (killed early, or not this CLI's version): no record

    # --- answers -------------------------------------------------------------------------

    def progress(self, output_tail: str) -> dict:
        """G4 body parts: ``{"output_tail", "last_message", "usage"}``."""
        return {"output_tail": output_tail, **self.parser.progress()}

    def entries_since(self, n: int) -> list[dict]:
        """G4: the transcript entries numbered above ``n`` (the parser keeps the last 500)."""
        return self.parser.entries_since(n)

    def final_extras(self, confirmed_n: int = 0) -> dict:
        """G3/G4/G5 keys of the final facts (H): agent_result, usage, agent_session_id,
        evidence, entries (module docstring)."""
        facts = self.parser.facts()
        return {
            "agent_result": facts["agent_result"],
            "usage": facts["usage"],
            "agent_session_id": facts["agent_session_id"],
            "evidence": {"git": self.git_end} if self.git_end is not None else {},
            "entries": self.entries_since(confirmed_n)[-ENTRIES_PER_POST:],
        }


def recovered_extras(*, parser: str, op_dir: str, folder: str | None, worktree: dict | None = None,
                     prompt: str | None = None, record: str | None = None,
                     turn_prompts: list[tuple[int, str]] = ()) -> dict:
    """X3: the same keys for an operation a previous worker ran, from its output file (and
    run record) and the git start it recorded (no git start recorded -> no git evidence);
    ``worktree``: the worktree it recorded (G7), whose branch and diff join the evidence.
    The transcript is numbered as the live run numbered it (same prompt, or a live
    conversation's ``turn_prompts``, same stream); its last entries go (the service keeps
    each number once)."""
    if worktree is not None:
        folder = worktree["cwd"]
    observer = AgentObserver(parser=parser, op_dir=op_dir, folder=folder or "/", worktree=worktree, prompt=prompt,
                             record=record)
    for seq, text in turn_prompts:
        observer.parser.turn_prompt(seq, text)
    observer.finish()
    saved = _read_json(os.path.join(op_dir, "git_start.json")) or {}
    if folder and saved.get("git") is not None:
        observer.git_start = saved["git"]
        observer.record_git_end()
    return observer.final_extras()


def _write_json(path: str, data: dict) -> None:
    """``data`` as the JSON file ``path``, atomic, not fsynced; a failure is ignored (the file stays as it was)."""
    try:
        write_atomic(path, json.dumps(data), sync=False)
    except OSError:
        pass


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            value = json.load(f)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None
