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
import threading
import time
from dataclasses import dataclass

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
        """stdout of ``git args`` (at most MAX_OUTPUT_BYTES, decoded), or None when git is
        missing, fails, or runs past its timeout or the budget."""
        done = self.call(*args)
        if done.code != 0:
            return None
        return done.stdout[:MAX_OUTPUT_BYTES].decode("utf-8", errors="replace")

    def call(self, *args: str, timeout_s: float | None = None, hooks: bool = True,
             max_bytes: int | None = None) -> GitResult:
        """Run ``git -C folder args`` and return its exit code and output. ``code`` is
        ``None`` when git is missing or it ran past ``timeout_s`` (default the per-call
        timeout; never past the budget); ``hooks=False`` runs none of the repository's
        hooks (``core.hooksPath=/dev/null``). With ``max_bytes``, stdout is read up to
        that many bytes plus one, then git is stopped (``GitResult.cut``), so a huge
        output never fills memory."""
        left = self.end - time.monotonic()
        if self.git is None or left <= 0:
            return GitResult(None, b"", "git not found" if self.git is None else "git time budget spent")
        argv = [self.git, "-C", self.folder, "-c", "core.fsmonitor=false", "-c", "core.quotepath=off"]
        if not hooks:
            argv += ["-c", "core.hooksPath=/dev/null"]
        timeout = min(timeout_s or self.timeout_s, left)
        try:
            if max_bytes is None:
                done = subprocess.run([*argv, *args], stdin=subprocess.DEVNULL, capture_output=True,
                                      timeout=timeout, env=self.env, check=False)
                return GitResult(done.returncode, done.stdout,
                                 done.stderr[:MAX_OUTPUT_BYTES].decode("utf-8", errors="replace"))
            return _bounded(argv + list(args), env=self.env, timeout=timeout, max_bytes=max_bytes)
        except subprocess.TimeoutExpired:
            return GitResult(None, b"", f"git {args[0] if args else ''} ran past {timeout:g} s")
        except OSError as exc:
            return GitResult(None, b"", str(exc))


@dataclass(frozen=True)
class GitResult:
    """One git run: ``code`` (None: not run to its end), raw ``stdout``, ``stderr`` text,
    and ``cut`` when stdout went past ``max_bytes`` and git was stopped."""

    code: int | None
    stdout: bytes
    stderr: str
    cut: bool = False

    @property
    def ok(self) -> bool:
        return self.code == 0

    @property
    def text(self) -> str:
        return self.stdout.decode("utf-8", errors="replace")


def _bounded(argv: list[str], *, env: dict, timeout: float, max_bytes: int) -> GitResult:
    """Run ``argv`` reading at most ``max_bytes + 1`` bytes of stdout; stop it there or
    at ``timeout`` seconds (raises ``subprocess.TimeoutExpired``)."""
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    try:
        data = proc.stdout.read(max_bytes + 1)
        cut = len(data) > max_bytes
        if cut:
            proc.kill()
        code = proc.wait()
    finally:
        timer.cancel()
        proc.stdout.close()
    if not cut and code < 0:
        raise subprocess.TimeoutExpired(argv, timeout)
    return GitResult(0 if cut else code, data[:max_bytes] if cut else data, "", cut=cut)


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
