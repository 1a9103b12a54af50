"""Worktree tasks (SPEC G7): a task on a branch of its own, its diff as evidence, and the
git side of merge or discard. Standard library only; git as in G5 (``git_evidence.Git``:
no shell, ``GIT_OPTIONAL_LOCKS=0``, a 5 s timeout per read), none of the repository's
hooks for what RunStead itself runs, and ``WRITE_TIMEOUT_S`` for the few commands that
write a work tree (a checkout of a large repository takes longer than 5 s).

The worktree of an operation lives at ``<state dir>/worktrees/<operation id>``, never
inside the user's checkout; the branch ``runstead/<first 8 of the task id>`` is made from
the folder's ``HEAD`` commit when the agent is about to start. A task folder below the
repository's top level runs the agent in the same subfolder of the worktree.

What a careful git user expects, where the spec is silent (README "Worktree tasks"):

- **Branch name taken** (by any branch: an old task's, the user's): RunStead never moves
  or overwrites a branch it did not make; it uses ``runstead/<full task id>`` instead, and
  refuses the start when that is taken too.
- **Detached HEAD** at spawn: the task runs from that commit; the evidence says
  ``base_branch: null`` and the service refuses a merge (there is no branch to merge
  into); discard works, and the branch stays mergeable by hand.
- **Uncommitted work the agent leaves** in its worktree is committed on the task's branch
  when it ends (author "RunStead" unless the repository has an identity), so the diff the
  owner reviews is exactly what a merge brings.
- **Merge** goes into ``base_branch``, to the reviewed commit (the branch's head at the
  end of the task, not whatever it points at later): a fast-forward when the base has not
  moved, else a merge commit computed with ``git merge-tree --write-tree`` (git 2.38+)
  without touching any checkout. A conflict is found there, so no checkout ever holds a
  half merge (stronger than ``git merge --abort``). The base then moves in one step: in
  the checkout where ``base_branch`` is checked out with ``git merge --ff-only`` to that
  commit (refused as ``base_dirty`` when its uncommitted changes touch the merged
  paths), else with a compare-and-set ``git update-ref``. Moving a branch to a recorded
  commit is idempotent, which is what makes a restarted worker never merge twice.
- **Base branch deleted meanwhile**: ``base_missing``; nothing is recreated, the task's
  branch stays.
- **Removal** (after discard or a merge): ``git worktree remove`` without force (a worktree
  changed after the task ended is kept and said so) and the branch deleted only while it
  still points at the reviewed commit and is checked out nowhere.
"""
from __future__ import annotations

import os
import shutil
import threading
import time
from dataclasses import dataclass

from .git_evidence import Git

WORKTREES_DIR = "worktrees"
BRANCH_PREFIX = "runstead/"
DIFF_MAX_BYTES = 256 * 1024  # H: evidence.git.diff, cut at a file boundary past this
MAX_FILES = 500  # evidence.git.files entries kept (files_changed counts them all)
PATH_CHARS = 1024
WRITE_TIMEOUT_S = 60.0  # worktree add, add -A, commit, merge --ff-only: they write files
LOCK_RETRY_S = 10.0  # a checkout's index.lock held by another git: how long to wait for it
LOCK_RETRY_STEP_S = 0.25
FALLBACK_IDENTITY = ("RunStead", "runstead@localhost")
OUTCOMES = ("merged", "discarded", "conflict", "base_dirty", "base_missing", "failed")
FILE_STATUSES = frozenset("ACDMRTUXB")

_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()


class WorktreeError(Exception):
    """A git step of a worktree task failed; the message says which and why."""


def repo_lock(common_dir: str) -> threading.Lock:
    """One lock per repository (its common git directory) in this worker process: worktree
    creation, removal and merges of one repository never interleave."""
    with _locks_guard:
        return _locks.setdefault(common_dir, threading.Lock())


@dataclass(frozen=True)
class Repo:
    """The git work tree holding a task folder: ``toplevel`` (realpath), ``prefix`` (the
    folder below it, ``""`` or ``"sub/dir"``), ``head`` (the commit, None before the first
    one), ``base_branch`` (short name of the branch ``HEAD`` is on, None when detached) and
    ``common_dir`` (the repository, shared by all its worktrees)."""

    toplevel: str
    prefix: str
    head: str | None
    base_branch: str | None
    common_dir: str


def find_repo(folder: str) -> Repo | None:
    """The work tree ``folder`` is in, or None outside any (or without git)."""
    git = Git(folder)
    inside = git.run("rev-parse", "--is-inside-work-tree")
    if inside is None or inside.strip() != "true":
        return None
    toplevel = (git.run("rev-parse", "--show-toplevel") or "").strip()
    common = (git.run("rev-parse", "--path-format=absolute", "--git-common-dir") or "").strip()
    if not toplevel or not common:
        return None
    prefix = (git.run("rev-parse", "--show-prefix") or "").strip().strip("/")
    head = (git.run("rev-parse", "--verify", "--quiet", "HEAD^{commit}") or "").strip() or None
    branch = (git.run("symbolic-ref", "-q", "--short", "HEAD") or "").strip() or None
    return Repo(toplevel=os.path.realpath(toplevel), prefix=prefix, head=head, base_branch=branch,
                common_dir=os.path.realpath(common))


def _branch_exists(git: Git, branch: str) -> bool:
    done = git.call("show-ref", "--verify", "--quiet", f"refs/heads/{branch}")
    if done.code not in (0, 1):
        raise WorktreeError(f"git show-ref failed: {done.stderr.strip()[:300]}")
    return done.code == 0


def plan(repo: Repo, *, state_path: str, operation_id: str, task_id: str) -> dict:
    """Where and on which branch an operation's worktree goes, before it exists:
    ``{path, cwd, branch, base, base_branch, repo, common_dir, prefix}`` (kept in the
    worker's record, so a restarted worker knows it). Raises ``WorktreeError`` when both
    branch names are taken or git fails."""
    git = Git(repo.toplevel)
    for branch in (f"{BRANCH_PREFIX}{task_id[:8]}", f"{BRANCH_PREFIX}{task_id}"):
        if not _branch_exists(git, branch):
            break
    else:
        raise WorktreeError(f"branches {BRANCH_PREFIX}{task_id[:8]} and {BRANCH_PREFIX}{task_id} both exist already")
    path = os.path.join(state_path, WORKTREES_DIR, operation_id)
    return {"path": path, "cwd": os.path.join(path, repo.prefix) if repo.prefix else path, "branch": branch,
            "base": repo.head, "base_branch": repo.base_branch, "repo": repo.toplevel,
            "common_dir": repo.common_dir, "prefix": repo.prefix}


def create(info: dict) -> None:
    """``git worktree add -b <branch> <path> <base>``; on failure whatever it made is
    removed again and ``WorktreeError`` raised."""
    os.makedirs(os.path.dirname(info["path"]), mode=0o700, exist_ok=True)
    with repo_lock(info["common_dir"]):
        if os.path.exists(info["path"]):
            raise WorktreeError(f"{info['path']} exists already")
        done = Git(info["repo"]).call("worktree", "add", "--quiet", "-b", info["branch"], info["path"], info["base"],
                                      timeout_s=WRITE_TIMEOUT_S, hooks=False)
        if done.ok and os.path.isdir(info["cwd"]):
            return
        _remove_locked(info, expected_head=info["base"], delete_branch=True, force=True)
    raise WorktreeError(f"git worktree add failed: {done.stderr.strip()[:300] or 'the folder is missing in it'}")


def _identity(git: Git) -> tuple[str, ...]:
    """``-c user.name=... -c user.email=...`` when the repository has no identity."""
    if (git.run("config", "user.email") or "").strip() and (git.run("config", "user.name") or "").strip():
        return ()
    name, email = FALLBACK_IDENTITY
    return ("-c", f"user.name={name}", "-c", f"user.email={email}")


def _paths(data: bytes) -> list[str]:
    return [p.decode("utf-8", errors="replace") for p in data.split(b"\0") if p]


def _status_paths(git: Git) -> set[str] | None:
    """Paths with uncommitted changes (untracked files each listed), both sides of a rename."""
    done = git.call("status", "--porcelain=v1", "-z", "--untracked-files=all")
    if not done.ok:
        return None
    entries = done.stdout.split(b"\0")
    paths, i = set(), 0
    while i < len(entries):
        entry = entries[i].decode("utf-8", errors="replace")
        i += 1
        if len(entry) < 4:
            continue
        paths.add(entry[3:])
        if "R" in entry[:2] or "C" in entry[:2]:
            paths.add(entries[i].decode("utf-8", errors="replace"))
            i += 1
    return paths


def commit_leftovers(info: dict, *, task_id: str) -> bool:
    """What the agent left uncommitted in its worktree becomes one commit on the task's
    branch (when the worktree is still on it). Returns whether a commit was made."""
    git = Git(info["path"])
    if (git.run("symbolic-ref", "-q", "HEAD") or "").strip() != f"refs/heads/{info['branch']}":
        return False
    if not _status_paths(git):
        return False
    if not git.call("add", "-A", timeout_s=WRITE_TIMEOUT_S, hooks=False).ok:
        return False
    message = f"RunStead task {task_id}: work the agent left uncommitted"
    return git.call(*_identity(git), "commit", "-q", "--no-verify", "-m", message, timeout_s=WRITE_TIMEOUT_S,
                    hooks=False).ok


def _head_of(git: Git, branch: str) -> str | None:
    return (git.run("rev-parse", "--verify", "--quiet", f"refs/heads/{branch}^{{commit}}") or "").strip() or None


def branch_head(info: dict) -> str | None:
    """The commit the operation's branch points at, or None when it is gone."""
    return _head_of(Git(info["repo"]), info["branch"])


DIFF_ARGS = ("diff", "--no-color", "--no-ext-diff", "--no-textconv", "-M", "--src-prefix=a/", "--dst-prefix=b/")


def diff_files(git: Git, base: str, end: str) -> list[dict] | None:
    """``[{path, status, insertions, deletions, old_path?}]`` of ``base..end`` in git's
    order (the unified diff's order too); counts are None for binary files."""
    names = git.call(*DIFF_ARGS, "--name-status", "-z", base, end, "--")
    counts = git.call(*DIFF_ARGS, "--numstat", "-z", base, end, "--")
    if not names.ok or not counts.ok:
        return None
    files = []
    tokens = names.stdout.split(b"\0")
    i = 0
    while i < len(tokens) and tokens[i]:
        status = tokens[i].decode()
        entry = {"status": status[0]}
        if status[0] in "RC":
            entry["old_path"], entry["path"] = tokens[i + 1].decode(errors="replace"), tokens[i + 2].decode(errors="replace")
            i += 3
        else:
            entry["path"] = tokens[i + 1].decode(errors="replace")
            i += 2
        files.append(entry)
    numbers = []
    tokens = counts.stdout.split(b"\0")
    i = 0
    while i < len(tokens) and tokens[i]:
        added, deleted, path = tokens[i].decode(errors="replace").split("\t", 2)
        i += 3 if path == "" else 1  # a rename: "+\t-\t" then old and new path
        numbers.append((None if added == "-" else int(added), None if deleted == "-" else int(deleted)))
    for entry, (added, deleted) in zip(files, numbers if len(numbers) == len(files) else [(None, None)] * len(files)):
        entry["insertions"], entry["deletions"] = added, deleted
        entry["path"] = entry["path"][:PATH_CHARS]
        if "old_path" in entry:
            entry["old_path"] = entry["old_path"][:PATH_CHARS]
    return files


def unified_diff(git: Git, base: str, end: str, *, max_bytes: int = DIFF_MAX_BYTES) -> tuple[str, bool] | None:
    """The unified diff of ``base..end`` as text of at most ``max_bytes`` UTF-8 bytes, cut
    at a file boundary (whole files only), and whether it was cut."""
    done = git.call(*DIFF_ARGS, base, end, "--", max_bytes=max_bytes)
    if not done.ok:
        return None
    data = done.stdout
    if not done.cut:
        text = data.decode("utf-8", errors="replace")
        if len(text.encode()) <= max_bytes:
            return text, False
    while True:  # whole files only: drop the last (partial) file until it fits
        boundary = data.rfind(b"\ndiff --git ", 0, max(0, len(data) - 1))
        data = data[: boundary + 1] if boundary >= 0 else b""
        text = data.decode("utf-8", errors="replace")
        if len(text.encode()) <= max_bytes:
            return text, True


def evidence(info: dict) -> dict:
    """The G7 part of ``evidence.git`` for a worktree whose agent has ended:
    ``{branch, base, base_branch, files, diff, truncated}`` (files and diff of
    ``base..<branch head>``; ``files`` empty and ``diff`` "" when git could not say)."""
    git = Git(info["path"])
    end = _head_of(git, info["branch"])
    out = {"branch": info["branch"], "base": info["base"], "base_branch": info["base_branch"], "files": [],
           "diff": "", "truncated": False}
    if end is None:
        return out
    files = diff_files(git, info["base"], end) or []
    diff = unified_diff(git, info["base"], end)
    out["files"] = files[:MAX_FILES]
    if diff is not None:
        out["diff"], out["truncated"] = diff
    out["truncated"] = out["truncated"] or len(files) > MAX_FILES
    return out


# --- removal ---------------------------------------------------------------------------


def _checked_out(git: Git) -> dict[str, str]:
    """``{"refs/heads/x": worktree path}`` for every branch checked out in a worktree."""
    out = git.run("worktree", "list", "--porcelain") or ""
    found, path = {}, None
    for line in out.splitlines():
        if line.startswith("worktree "):
            path = line[len("worktree "):]
        elif line.startswith("branch ") and path is not None:
            found[line[len("branch "):]] = path
    return found


def remove(info: dict, *, expected_head: str | None, delete_branch: bool) -> list[str]:
    """Remove the operation's worktree (never one changed since) and, with
    ``delete_branch``, its branch while it still points at ``expected_head`` and is
    checked out nowhere else. Returns notes for people (what was kept and why)."""
    with repo_lock(info["common_dir"]):
        return _remove_locked(info, expected_head=expected_head, delete_branch=delete_branch, force=False)


def _remove_locked(info: dict, *, expected_head, delete_branch: bool, force: bool) -> list[str]:
    notes = []
    git = Git(info["repo"])
    path = info["path"]
    if os.path.isdir(path):
        args = ("worktree", "remove", *(("--force", "--force") if force else ()), path)
        done = git.call(*args, timeout_s=WRITE_TIMEOUT_S, hooks=False)
        if not done.ok:
            if force or not os.path.exists(os.path.join(path, ".git")):
                shutil.rmtree(path, ignore_errors=True)  # not (or no longer) a worktree: a leftover folder
            else:
                notes.append(f"worktree kept at {path}: {done.stderr.strip()[:200] or 'git worktree remove failed'}")
    git.call("worktree", "prune")
    if delete_branch and not os.path.isdir(path):
        ref = f"refs/heads/{info['branch']}"
        current = _head_of(git, info["branch"])
        elsewhere = _checked_out(git).get(ref)
        if current is None:
            pass
        elif elsewhere:
            notes.append(f"branch {info['branch']} kept: it is checked out at {elsewhere}")
        elif expected_head and current != expected_head:
            notes.append(f"branch {info['branch']} kept: it moved past the reviewed commit {expected_head[:12]}")
        elif not git.call("update-ref", "-d", ref, current).ok:
            notes.append(f"branch {info['branch']} kept: git update-ref -d failed")
    elif delete_branch:
        notes.append(f"branch {info['branch']} kept with its worktree")
    return notes


# --- merge -----------------------------------------------------------------------------


def _is_ancestor(git: Git, older: str, newer: str) -> bool | None:
    done = git.call("merge-base", "--is-ancestor", older, newer)
    return {0: True, 1: False}.get(done.code)


def merge_plan(info: dict, *, head: str, task_id: str) -> dict:
    """Decide a merge of ``head`` (the reviewed commit) into ``base_branch`` without
    touching any checkout. Returns a final outcome ``{"outcome", "commit"?, "paths"?,
    "detail"?}`` (``merged`` when the base already holds it, ``conflict``, ``base_dirty``,
    ``base_missing``, ``failed``) or ``{"apply": {"old", "target", "kind", "checkout"}}``:
    move the base from ``old`` to ``target`` (``head`` itself for a fast-forward, else a
    new merge commit), in ``checkout`` (where the base is checked out) or by ``update-ref``."""
    git = Git(info["repo"])
    base_branch = info.get("base_branch")
    if not base_branch:
        return {"outcome": "failed", "detail": "the task started on a detached HEAD: no branch to merge into"}
    old = _head_of(git, base_branch)
    if old is None:
        return {"outcome": "base_missing", "detail": f"branch {base_branch} no longer exists; {info['branch']} kept"}
    if not git.call("cat-file", "-e", f"{head}^{{commit}}").ok:
        return {"outcome": "failed", "detail": f"the reviewed commit {head[:12]} is not in the repository"}
    contained = _is_ancestor(git, head, old)
    if contained:
        return {"outcome": "merged", "commit": old, "detail": f"{base_branch} already contains it"}
    forward = _is_ancestor(git, old, head)
    if contained is None or forward is None:
        return {"outcome": "failed", "detail": "git merge-base failed"}
    if forward:
        target, kind = head, "fast-forward"
    else:
        done = git.call("merge-tree", "--write-tree", "--name-only", "--no-messages", "-z", old, head)
        tokens = [t for t in done.stdout.split(b"\0") if t]
        if done.code == 1 and tokens:
            return {"outcome": "conflict", "paths": _paths(b"\0".join(tokens[1:])),
                    "detail": f"{info['branch']} kept; nothing changed in {base_branch}"}
        if done.code != 0 or not tokens:
            return {"outcome": "failed", "detail": f"git merge-tree failed: {done.stderr.strip()[:200]}"}
        message = f"Merge branch '{info['branch']}' into {base_branch}\n\nRunStead task {task_id}"
        made = git.call(*_identity(git), "commit-tree", tokens[0].decode(), "-p", old, "-p", head, "-m", message)
        if not made.ok:
            return {"outcome": "failed", "detail": f"git commit-tree failed: {made.stderr.strip()[:200]}"}
        target, kind = made.text.strip(), "merge commit"
    checkout = _checked_out(git).get(f"refs/heads/{base_branch}")
    if checkout:
        dirty = _dirty_overlap(checkout, old, target, git)
        if dirty is None:
            return {"outcome": "failed", "detail": f"git status failed in {checkout}"}
        if dirty:
            return {"outcome": "base_dirty", "paths": dirty,
                    "detail": f"uncommitted changes in {checkout} touch the merged paths; nothing changed"}
    return {"apply": {"old": old, "target": target, "kind": kind, "checkout": checkout}}


def _dirty_overlap(checkout: str, old: str, target: str, git: Git) -> list[str] | None:
    """Paths the merge would change that have uncommitted changes in ``checkout``."""
    dirty = _status_paths(Git(checkout))
    changed = git.call("diff", "--no-ext-diff", "--name-only", "-z", old, target, "--")
    if dirty is None or not changed.ok:
        return None
    return sorted(dirty & set(_paths(changed.stdout)))


def merge_state(info: dict, apply: dict) -> str:
    """Where a recorded merge stands: ``done`` (the base holds its target), ``pending``
    (the base is still at ``old``), ``moved`` (the base moved elsewhere: plan again) or
    ``missing`` (the base branch is gone)."""
    git = Git(info["repo"])
    current = _head_of(git, info["base_branch"])
    if current is None:
        return "missing"
    if current == apply["target"] or _is_ancestor(git, apply["target"], current):
        return "done"
    return "pending" if current == apply["old"] else "moved"


def merge_apply(info: dict, apply: dict, *, sleep=None) -> dict:
    """Move the base from ``old`` to ``target`` in one step (see ``merge_plan``). Returns
    ``{"outcome": "merged", "commit", "detail"}``, ``base_dirty`` / ``failed``, or
    ``{"retry": True}`` when the base moved meanwhile (plan again)."""
    sleep = sleep or time.sleep
    base_ref = f"refs/heads/{info['base_branch']}"
    merged = {"outcome": "merged", "commit": apply["target"], "detail": f"{apply['kind']} of {info['branch']}"}
    checkout = apply["checkout"]
    if not checkout:
        done = Git(info["repo"]).call("update-ref", "-m", f"runstead: merge {info['branch']}", base_ref,
                                      apply["target"], apply["old"])
        return merged if done.ok else {"retry": True}
    waited = 0.0
    while True:
        git = Git(checkout)
        if (git.run("symbolic-ref", "-q", "HEAD") or "").strip() != base_ref:
            return {"retry": True}  # the checkout switched branches meanwhile
        done = git.call("merge", "--ff-only", "--quiet", apply["target"], timeout_s=WRITE_TIMEOUT_S, hooks=False)
        if done.ok:
            return merged
        if ".lock" in done.stderr and waited < LOCK_RETRY_S:  # another git (perhaps our own, orphaned) holds it
            sleep(LOCK_RETRY_STEP_S)
            waited += LOCK_RETRY_STEP_S
            continue
        state = merge_state(info, apply)
        if state == "done":
            return merged
        if state != "pending":
            return {"retry": True}
        dirty = _dirty_overlap(checkout, apply["old"], apply["target"], Git(info["repo"]))
        if dirty:
            return {"outcome": "base_dirty", "paths": dirty,
                    "detail": f"uncommitted changes in {checkout} touch the merged paths; nothing changed"}
        return {"outcome": "failed", "detail": f"git merge --ff-only failed in {checkout}: {done.stderr.strip()[:200]}"}
