"""Real git repositories for the worktree tests (SPEC G7): ``git`` with a fixed identity
and none of the caller's ``GIT_*``, and the fingerprint of a user's checkout."""
import hashlib
import os
import subprocess

ENV = {**{k: v for k, v in os.environ.items() if not k.startswith("GIT_")}, "GIT_AUTHOR_NAME": "t",
       "GIT_AUTHOR_EMAIL": "t@example.com", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com"}


def git(repo, *args) -> str:
    """``git -C repo args...`` under ``ENV``; its stdout, stripped (raises on failure)."""
    return subprocess.run(["git", "-C", str(repo), *args], env=ENV, check=True, capture_output=True,
                          text=True).stdout.strip()


def checkout_fingerprint(repo) -> tuple:
    """What "the user's checkout is unchanged" means: ``git status --porcelain``, HEAD, the
    index file's bytes and every file outside .git (path, mode, bytes), hashed."""
    digest = hashlib.sha256()
    for root, dirs, files in os.walk(repo):
        dirs[:] = sorted(d for d in dirs if not (root == str(repo) and d == ".git"))
        for name in sorted(files):
            path = os.path.join(root, name)
            digest.update(os.path.relpath(path, repo).encode() + b"\0" + oct(os.lstat(path).st_mode).encode() + b"\0")
            with open(path, "rb") as f:
                digest.update(f.read())
    with open(os.path.join(repo, ".git", "index"), "rb") as f:
        index = hashlib.sha256(f.read()).hexdigest()
    status = subprocess.run(["git", "-C", str(repo), "status", "--porcelain"], env={**ENV, "GIT_OPTIONAL_LOCKS": "0"},
                            check=True, capture_output=True, text=True).stdout
    return status, git(repo, "rev-parse", "HEAD"), index, digest.hexdigest()
