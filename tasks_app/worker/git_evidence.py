"""Git evidence of what a task changed (SPEC G5, U4).

At spawn ``git_start(folder)`` records ``HEAD`` and the number of dirty paths; at the end
``git_end(folder, start)`` adds ``HEAD`` after, the commits made since (count and up to
20 subjects), ``git diff --shortstat`` from the start commit to the work tree (so
uncommitted changes to tracked files count; untracked files show in ``dirty``), and the
dirty paths. Shape (H, ``evidence.git``)::

    {"start_head": str | None, "end_head": str | None, "commits": int | None,
     "subjects": [str], "files_changed": int, "insertions": int, "deletions": int,
     "dirty": [str], "dirty_count": int, "start_dirty": int | None}

Every git call runs without a shell, with a 5 s timeout, ``GIT_OPTIONAL_LOCKS=0`` (a
status never takes the index lock an agent's git may need), no pager, no prompt, no
fsmonitor, and the C locale; all calls of one recording share a 15 s budget, so a hung
repository delays a final receipt by a bounded time. Outside a work tree (or without
git) there is no evidence: ``None``. Sizes are bounded (subjects 20 x 200 characters,
dirty paths 50 x 300 characters).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import time

GIT_TIMEOUT_S = 5.0
BUDGET_S = 15.0
MAX_SUBJECTS = 20
SUBJECT_CHARS = 200
MAX_DIRTY = 50
PATH_CHARS = 300
MAX_OUTPUT_BYTES = 1 << 20
EMPTY_TREE = "4b825dc642cb6eb9a060e54bf8d69288fbee4904"

_SHORTSTAT = {
    "files_changed": re.compile(r"(\d+) files? changed"),
    "insertions": re.compile(r"(\d+) insertions?\(\+\)"),
    "deletions": re.compile(r"(\d+) deletions?\(-\)"),
}


class Git:
    """Runs ``git -C folder ...`` under one time budget; ``run`` returns stdout or None."""

    def __init__(self, folder: str, *, timeout_s: float = GIT_TIMEOUT_S, budget_s: float = BUDGET_S,
                 git: str | None = None):
        self.folder = folder
        self.timeout_s = timeout_s
        self.end = time.monotonic() + budget_s
        self.git = git or shutil.which("git")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("GIT_", "RUNSTEAD_"))}
        env.update(GIT_OPTIONAL_LOCKS="0", GIT_TERMINAL_PROMPT="0", GIT_PAGER="cat", LC_ALL="C", LANG="C")
        self.env = env

    def run(self, *args: str) -> str | None:
        left = self.end - time.monotonic()
        if self.git is None or left <= 0:
            return None
        try:
            done = subprocess.run(
                [self.git, "-C", self.folder, "-c", "core.fsmonitor=false", "-c", "core.quotepath=off", *args],
                stdin=subprocess.DEVNULL, capture_output=True, timeout=min(self.timeout_s, left), env=self.env,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        if done.returncode != 0:
            return None
        return done.stdout[:MAX_OUTPUT_BYTES].decode("utf-8", errors="replace")


def _head(git: Git) -> str | None:
    out = git.run("rev-parse", "--verify", "--quiet", "HEAD^{commit}")
    return out.strip() or None if out is not None else None


def _dirty(git: Git) -> tuple[list[str], int] | None:
    out = git.run("status", "--porcelain=v1", "-z", "--untracked-files=normal")
    if out is None:
        return None
    paths, count = [], 0
    entries = out.split("\0")
    i = 0
    while i < len(entries):
        entry = entries[i]
        i += 1
        if len(entry) < 4:
            continue
        status, path = entry[:2], entry[3:]
        if "R" in status or "C" in status:
            i += 1  # -z puts a rename's source path in the next entry
        count += 1
        if len(paths) < MAX_DIRTY:
            paths.append(path[:PATH_CHARS])
    return paths, count


def git_start(folder: str, **kw) -> dict | None:
    """G5 at spawn: ``{"start_head", "start_dirty"}``, or None outside a git work tree."""
    git = Git(folder, **kw)
    inside = git.run("rev-parse", "--is-inside-work-tree")
    if inside is None or inside.strip() != "true":
        return None
    dirty = _dirty(git)
    return {"start_head": _head(git), "start_dirty": dirty[1] if dirty else None}


def git_end(folder: str, start: dict | None, **kw) -> dict | None:
    """G5 at the end: the full ``evidence.git`` shape (module docstring), or None outside
    a work tree. ``start`` is ``git_start``'s answer (None: the folder was not a work
    tree at spawn, or it was not recorded; then commits are counted from the root)."""
    git = Git(folder, **kw)
    inside = git.run("rev-parse", "--is-inside-work-tree")
    if inside is None or inside.strip() != "true":
        return None
    start = start or {}
    start_head = start.get("start_head")
    end_head = _head(git)
    commits, subjects = None, []
    if end_head is not None:
        span = f"{start_head}..HEAD" if start_head else "HEAD"
        count = git.run("rev-list", "--count", span)
        if count is not None and count.strip().isdigit():
            commits = int(count.strip())
        log = git.run("log", f"--max-count={MAX_SUBJECTS}", "--format=%s", span, "--")
        if log is not None:
            subjects = [s[:SUBJECT_CHARS] for s in log.splitlines()[:MAX_SUBJECTS]]
    elif start_head is None:
        commits = 0
    stat = {"files_changed": 0, "insertions": 0, "deletions": 0}
    base = start_head or (EMPTY_TREE if end_head else None)
    if base is not None:
        out = git.run("diff", "--shortstat", "--no-color", "--no-ext-diff", base, "--")
        if out:
            for key, pattern in _SHORTSTAT.items():
                m = pattern.search(out)
                if m:
                    stat[key] = int(m.group(1))
    dirty = _dirty(git)
    return {
        "start_head": start_head,
        "end_head": end_head,
        "commits": commits,
        "subjects": subjects,
        **stat,
        "dirty": dirty[0] if dirty else [],
        "dirty_count": dirty[1] if dirty else 0,
        "start_dirty": start.get("start_dirty"),
    }


def describe(git: dict | None) -> str:
    """One line for people (U4, B9): "2 commits, 5 files changed (+10 -3), 1 dirty path"."""
    if not git:
        return "no git evidence"
    parts = []
    commits = git.get("commits")
    if commits is not None:
        parts.append(f"{commits} commit{'s' if commits != 1 else ''}")
    files = git.get("files_changed") or 0
    parts.append(f"{files} file{'s' if files != 1 else ''} changed since the task started"
                 f" (+{git.get('insertions') or 0} -{git.get('deletions') or 0})")
    dirty = git.get("dirty_count") or 0
    if dirty:
        parts.append(f"{dirty} uncommitted path{'s' if dirty != 1 else ''}")
    return ", ".join(parts)
