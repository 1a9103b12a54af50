"""Git evidence (SPEC G5): real repositories in a temporary folder; a hanging git stands
in for a stuck repository (a script on the path, which is what a slow NFS git looks like
to the worker)."""
import json
import os
import subprocess
import sys
import time

import pytest

from tasks_app.agent_facts import describe_git as describe
from machine.worker.git_evidence import MAX_DIRTY, MAX_SUBJECTS, git_end, git_start

pytestmark = pytest.mark.backend_independent  # neither database nor layer (pytest.ini)

ENV = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com", "GIT_COMMITTER_NAME": "t",
       "GIT_COMMITTER_EMAIL": "t@example.com"}


def git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], env=ENV, check=True, capture_output=True,
                          text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path):
    path = tmp_path / "repo"
    path.mkdir()
    git(path, "init", "-q", "-b", "main")
    (path / "a.py").write_text("one\ntwo\n")
    git(path, "add", "a.py")
    git(path, "commit", "-q", "-m", "initial")
    return path


def test_g5_commits_shortstat_and_dirty_paths_since_the_start(repo):
    (repo / "scratch.txt").write_text("left from before\n")
    start = git_start(str(repo))
    assert start == {"start_head": git(repo, "rev-parse", "HEAD"), "start_dirty": 1}

    (repo / "a.py").write_text("one\nTWO\nthree\n")
    git(repo, "commit", "-qam", "fix: two is loud")
    (repo / "b.py").write_text("b\n")
    git(repo, "add", "b.py")
    git(repo, "commit", "-qm", "feat: add b")
    (repo / "b.py").write_text("b\nmore\n")  # uncommitted change to a tracked file counts
    (repo / "new dir").mkdir()
    (repo / "new dir" / "n.txt").write_text("untracked\n")

    end = git_end(str(repo), start)
    assert end == {
        "start_head": start["start_head"],
        "end_head": git(repo, "rev-parse", "HEAD"),
        "commits": 2,
        "subjects": ["feat: add b", "fix: two is loud"],
        "files_changed": 2,
        "insertions": 4,
        "deletions": 1,
        "dirty": ["b.py", "new dir/", "scratch.txt"],
        "dirty_count": 3,
        "start_dirty": 1,
    }
    assert describe(end) == "2 commits, 2 files changed since the task started (+4 -1), 3 uncommitted paths"


def test_g5_outside_a_work_tree_there_is_no_evidence(tmp_path):
    assert git_start(str(tmp_path)) is None
    assert git_end(str(tmp_path), None) is None
    assert describe(None) == "no git evidence"


def test_g5_a_repository_without_commits_at_the_start_counts_from_the_root(tmp_path):
    path = tmp_path / "empty"
    path.mkdir()
    git(path, "init", "-q")
    start = git_start(str(path))
    assert start == {"start_head": None, "start_dirty": 0}
    (path / "x").write_text("1\n2\n")
    git(path, "add", "x")
    git(path, "commit", "-qm", "first ever")
    end = git_end(str(path), start)
    assert (end["commits"], end["subjects"], end["files_changed"], end["insertions"]) == (1, ["first ever"], 1, 2)


def test_g5_sizes_are_bounded(repo):
    start = git_start(str(repo))
    for i in range(MAX_SUBJECTS + 5):
        git(repo, "commit", "-q", "--allow-empty", "-m", f"c{i} " + "s" * 300)
    for i in range(MAX_DIRTY + 20):
        (repo / f"f{i:03}.txt").write_text("x")
    end = git_end(str(repo), start)
    assert end["commits"] == MAX_SUBJECTS + 5
    assert len(end["subjects"]) == MAX_SUBJECTS and all(len(s) <= 200 for s in end["subjects"])
    assert len(end["dirty"]) == MAX_DIRTY and end["dirty_count"] == MAX_DIRTY + 20


def test_g5_git_runs_without_optional_locks_or_a_shell_and_within_its_timeout(tmp_path):
    """A fake git records its environment, then hangs: the call gives up at the timeout."""
    record = tmp_path / "env.json"
    fake = tmp_path / "git"
    fake.write_text(f"#!{sys.executable}\nimport json, os, sys, time\n"
                    f"json.dump({{'env': dict(os.environ), 'argv': sys.argv, 'ppid_comm': open(f'/proc/{{os.getppid()}}/comm').read()}}, open({str(record)!r}, 'w'))\n"
                    "time.sleep(30)\n")
    fake.chmod(0o755)
    os.environ["GIT_DIR"] = "/somewhere/else"  # a stray GIT_DIR must not redirect the evidence
    try:
        started = time.monotonic()
        assert git_start(str(tmp_path), git=str(fake), timeout_s=0.5) is None
        elapsed = time.monotonic() - started
    finally:
        del os.environ["GIT_DIR"]
    seen = json.loads(record.read_text())
    assert elapsed < 3
    assert seen["env"]["GIT_OPTIONAL_LOCKS"] == "0" and "GIT_DIR" not in seen["env"]
    assert seen["argv"][1:4] == ["-C", str(tmp_path), "-c"]
    assert seen["ppid_comm"].strip() not in ("sh", "bash", "dash")  # spawned directly, no shell


def test_g5_one_budget_for_all_calls_of_a_recording(tmp_path):
    fake = tmp_path / "git"
    fake.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(30)\n")
    fake.chmod(0o755)
    started = time.monotonic()
    assert git_end(str(tmp_path), {"start_head": "abc"}, git=str(fake), timeout_s=5, budget_s=0.5) is None
    assert time.monotonic() - started < 3
