"""The identity of the git repositories this worker may work in (SPEC C8).

A task of ``"machine": "any"`` names a folder; the service picks a machine that has the
same repository, wherever it lives there. The worker says which repositories it has: at
start (with its profiles, B10) it reports, for each allowed root that is the top of a git
work tree and for each direct sub-folder of a root that is one, ``{"path", "remote",
"root_commit"}``: ``path`` the work tree's top (real path), ``remote`` the URL of
``origin`` with any user name or password removed (never sent), ``root_commit`` the
smallest of its root commits (``git rev-list --max-parents=0 HEAD``; null in a
repository with no commit yet). Two clones of one repository share their root commit
whatever their remotes; the service compares both (``tasks_app/services/machine_choice``).

Bounded: at most ``MAX_REPOSITORIES`` repositories, ``MAX_CHILDREN`` sub-folders looked
at per root, and every git call under one ``BUDGET_S`` budget (``git_evidence.Git``), so
a start is never held up by a slow disk for long. Deeper repositories are not reported:
give their folders (or their parent) as allowed roots.
"""
from __future__ import annotations

import os
import re
import time

from .git_evidence import Git

MAX_REPOSITORIES = 200
MAX_CHILDREN = 500
BUDGET_S = 20.0
REMOTE_CHARS = 1000

_USERINFO = re.compile(r"^([a-z][a-z0-9+.-]*://)[^/@]*@", re.IGNORECASE)


def strip_credentials(url: str) -> str:
    """``url`` without the ``user:password@`` of a URL with a scheme (a token in an HTTPS
    remote stays on the machine). ``git@host:path`` (scp form) names no secret and stays."""
    return _USERINFO.sub(r"\1", url.strip())


def repository_identity(folder: str, *, deadline: float) -> dict | None:
    """``{"path", "remote", "root_commit"}`` of the work tree whose top is ``folder``, or
    None when ``folder`` is not the top of a git work tree (or git is missing or slow)."""
    git = Git(folder, budget_s=max(0.0, deadline - time.monotonic()))
    top = git.run("rev-parse", "--show-toplevel")
    if top is None or os.path.realpath(top.strip()) != os.path.realpath(folder):
        return None
    remote = git.run("config", "--get", "remote.origin.url")
    roots = git.run("rev-list", "--max-parents=0", "HEAD")
    root_commits = sorted((roots or "").split())
    return {
        "path": os.path.realpath(folder),
        "remote": strip_credentials(remote)[:REMOTE_CHARS] if remote and remote.strip() else None,
        "root_commit": root_commits[0] if root_commits else None,
    }


def repository_identities(roots, *, budget_s: float = BUDGET_S) -> list[dict]:
    """The repositories under ``roots`` (each root itself, then its direct sub-folders in
    name order), sorted by path, at most ``MAX_REPOSITORIES``."""
    deadline = time.monotonic() + budget_s
    found: dict[str, dict] = {}
    for root in roots:
        candidates = [root]
        try:
            with os.scandir(root) as entries:
                names = sorted(e.name for e in entries if e.is_dir(follow_symlinks=False) and not e.name.startswith("."))
        except OSError:
            names = []
        candidates += [os.path.join(root, name) for name in names[:MAX_CHILDREN]]
        for folder in candidates:
            if len(found) >= MAX_REPOSITORIES or time.monotonic() >= deadline:
                break
            if not os.path.isdir(os.path.join(folder, ".git")) and not os.path.isfile(os.path.join(folder, ".git")):
                continue
            identity = repository_identity(folder, deadline=deadline)
            if identity is not None:
                found.setdefault(identity["path"], identity)
    return sorted(found.values(), key=lambda r: r["path"])[:MAX_REPOSITORIES]
