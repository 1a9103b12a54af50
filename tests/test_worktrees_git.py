"""The git side of worktree tasks (SPEC G7), on real repositories in a temporary folder:
branch names, the worktree, leftovers committed on the branch, the diff as evidence (files,
unified diff cut at a file boundary), removal, and merge planning and applying. No Django,
no worker: ``machine.worker.worktrees`` alone."""
import os

import pytest

from machine.worker import worktrees as w
from tests.git_support import checkout_fingerprint, git

pytestmark = pytest.mark.backend_independent  # neither database nor layer (pytest.ini)

TASK_ID = "0123abcd-0000-4000-8000-00000000feed"


@pytest.fixture
def repo(tmp_path):
    path = tmp_path / "repo"
    path.mkdir()
    git(path, "init", "-q", "-b", "main")
    git(path, "config", "user.name", "t")
    git(path, "config", "user.email", "t@example.com")
    (path / "a.txt").write_text("one\ntwo\nthree\n")
    (path / "sub").mkdir()
    (path / "sub" / "b.txt").write_text("b\n")
    git(path, "add", "-A")
    git(path, "commit", "-qm", "initial")
    return path


def made(repo, tmp_path, *, folder=None, task_id=TASK_ID):
    found = w.find_repo(str(folder or repo))
    info = {**w.plan(found, state_path=str(tmp_path / "state"), operation_id="op-1", task_id=task_id),
            "task_id": task_id}
    w.create(info)
    return info


def test_g7_worktree_on_its_own_branch_outside_the_checkout_which_stays_unchanged(repo, tmp_path):
    (repo / "a.txt").write_text("one\ntwo\nthree\nthe user's uncommitted line\n")
    (repo / "scratch.txt").write_text("untracked\n")
    before = checkout_fingerprint(repo)
    info = made(repo, tmp_path, folder=repo / "sub")
    assert info["branch"] == "runstead/0123abcd"
    assert info["base"] == git(repo, "rev-parse", "HEAD") and info["base_branch"] == "main"
    assert info["path"] == str(tmp_path / "state" / "worktrees" / "op-1")
    assert info["cwd"] == os.path.join(info["path"], "sub")  # the task folder's place in the worktree
    assert (tmp_path / "state" / "worktrees" / "op-1" / "a.txt").read_text() == "one\ntwo\nthree\n"  # from HEAD
    assert git(info["path"], "symbolic-ref", "--short", "HEAD") == "runstead/0123abcd"
    assert checkout_fingerprint(repo) == before


def test_g7_a_taken_branch_name_is_never_reused_the_full_task_id_is(repo, tmp_path):
    git(repo, "branch", "runstead/0123abcd")
    theirs = git(repo, "rev-parse", "runstead/0123abcd")
    found = w.find_repo(str(repo))
    assert w.plan(found, state_path=str(tmp_path), operation_id="op", task_id=TASK_ID)["branch"] == f"runstead/{TASK_ID}"
    git(repo, "branch", f"runstead/{TASK_ID}")
    with pytest.raises(w.WorktreeError, match="both exist"):
        w.plan(found, state_path=str(tmp_path), operation_id="op", task_id=TASK_ID)
    assert git(repo, "rev-parse", "runstead/0123abcd") == theirs


def test_g7_detached_head_and_outside_a_work_tree(repo, tmp_path):
    git(repo, "checkout", "-q", "--detach")
    found = w.find_repo(str(repo))
    assert found.base_branch is None and found.head == git(repo, "rev-parse", "HEAD")
    assert w.find_repo(str(tmp_path)) is None
    empty = tmp_path / "empty"
    empty.mkdir()
    git(empty, "init", "-q")
    assert w.find_repo(str(empty)).head is None


def test_g7_leftovers_become_a_commit_and_the_diff_is_the_evidence(repo, tmp_path):
    info = made(repo, tmp_path)
    wt = info["path"]
    (tmp_path / "state" / "worktrees" / "op-1" / "a.txt").write_text("one\nTWO\nthree\nfour\n")
    git(wt, "commit", "-qam", "agent: two is loud")
    os.rename(os.path.join(wt, "sub", "b.txt"), os.path.join(wt, "sub", "c.txt"))  # uncommitted rename
    with open(os.path.join(wt, "new <b>.bin"), "wb") as f:
        f.write(b"\x00\x01binary")
    assert w.commit_leftovers(info, task_id=TASK_ID) is True
    assert git(wt, "status", "--porcelain") == ""
    assert git(wt, "log", "-1", "--format=%s %an") == f"RunStead task {TASK_ID}: work the agent left uncommitted t"
    ev = w.evidence(info)
    assert (ev["branch"], ev["base"], ev["base_branch"], ev["truncated"]) == ("runstead/0123abcd", info["base"], "main", False)
    assert ev["files"] == [
        {"status": "M", "path": "a.txt", "insertions": 2, "deletions": 1},
        {"status": "A", "path": "new <b>.bin", "insertions": None, "deletions": None},
        {"status": "R", "old_path": "sub/b.txt", "path": "sub/c.txt", "insertions": 0, "deletions": 0},
    ]
    assert ev["diff"].startswith("diff --git a/a.txt b/a.txt\n") and "+TWO\n" in ev["diff"]
    assert "Binary files /dev/null and b/new <b>.bin differ" in ev["diff"]
    assert "rename from sub/b.txt" in ev["diff"]
    assert w.commit_leftovers(info, task_id=TASK_ID) is False  # nothing left


def test_g7_a_diff_past_the_limit_is_cut_at_a_file_boundary(repo, tmp_path):
    info = made(repo, tmp_path)
    wt = info["path"]
    for name, lines in (("f1.txt", 300), ("f2.txt", 300), ("f3.txt", 3000)):
        with open(os.path.join(wt, name), "w") as f:
            f.write("".join(f"line {i} <script>alert(1)</script>\n" for i in range(lines)))
    w.commit_leftovers(info, task_id=TASK_ID)
    git_ = w.Git(wt)
    full, cut = w.unified_diff(git_, info["base"], "HEAD")
    assert cut is False
    limit = len(full.encode()) - 100
    text, cut = w.unified_diff(git_, info["base"], "HEAD", max_bytes=limit)
    assert cut is True and len(text.encode()) <= limit
    assert text.count("diff --git ") == 2 and text.endswith("</script>\n")  # f1 and f2 whole, f3 left out
    assert full.startswith(text)
    text, cut = w.unified_diff(git_, info["base"], "HEAD", max_bytes=100)
    assert (text, cut) == ("", True)  # not even the first file fits: no partial file


def test_g7_remove_keeps_what_changed_after_the_review(repo, tmp_path):
    info = made(repo, tmp_path)
    head = info["base"]
    (tmp_path / "state" / "worktrees" / "op-1" / "late.txt").write_text("edited after the task\n")
    notes = w.remove(info, expected_head=head, delete_branch=True)
    assert os.path.isdir(info["path"]) and "worktree kept" in notes[0] and "branch runstead/0123abcd kept" in notes[1]
    os.remove(os.path.join(info["path"], "late.txt"))
    git(info["path"], "commit", "-q", "--allow-empty", "-m", "moved on")
    notes = w.remove(info, expected_head=head, delete_branch=True)
    assert not os.path.exists(info["path"]) and "moved past the reviewed commit" in notes[0]
    assert git(repo, "branch", "--list", "runstead/*") == "runstead/0123abcd"
    assert w.remove(info, expected_head=git(repo, "rev-parse", "runstead/0123abcd"), delete_branch=True) == []
    assert git(repo, "branch", "--list", "runstead/*") == ""


def agent_commit(info, name, text, message):
    with open(os.path.join(info["path"], name), "w") as f:
        f.write(text)
    git(info["path"], "add", "-A")
    git(info["path"], "commit", "-qm", message)
    return git(info["path"], "rev-parse", "HEAD")


def test_g7_merge_fast_forwards_the_checked_out_base_and_keeps_unrelated_local_changes(repo, tmp_path):
    info = made(repo, tmp_path)
    head = agent_commit(info, "new.txt", "new\n", "agent: add new")
    (repo / "scratch.txt").write_text("the user's own untracked file\n")
    plan = w.merge_plan(info, head=head, task_id=TASK_ID)
    assert plan["apply"]["kind"] == "fast-forward" and plan["apply"]["checkout"] == str(repo)
    assert w.merge_state(info, plan["apply"]) == "pending"
    assert w.merge_apply(info, plan["apply"]) == {"outcome": "merged", "commit": head,
                                                  "detail": "fast-forward of runstead/0123abcd"}
    assert git(repo, "rev-parse", "main") == head and (repo / "new.txt").read_text() == "new\n"
    assert (repo / "scratch.txt").exists() and git(repo, "status", "--porcelain") == "?? scratch.txt"
    assert w.merge_state(info, plan["apply"]) == "done"
    assert w.merge_apply(info, plan["apply"])["outcome"] == "merged"  # again: nothing more happens
    assert git(repo, "rev-list", "--count", "main") == "2"
    assert w.merge_plan(info, head=head, task_id=TASK_ID)["outcome"] == "merged"  # the base holds it


def test_g7_merge_commit_when_the_base_moved_and_conflicts_change_nothing(repo, tmp_path):
    info = made(repo, tmp_path)
    head = agent_commit(info, "new.txt", "new\n", "agent: add new")
    (repo / "b2.txt").write_text("user\n")
    git(repo, "add", "b2.txt")
    git(repo, "commit", "-qm", "user: meanwhile")
    plan = w.merge_plan(info, head=head, task_id=TASK_ID)["apply"]
    assert plan["kind"] == "merge commit"
    assert w.merge_apply(info, plan)["commit"] == plan["target"] == git(repo, "rev-parse", "main")
    assert git(repo, "log", "-1", "--format=%P") == f"{plan['old']} {head}"
    assert git(repo, "status", "--porcelain") == ""

    other = made(repo, tmp_path / "x", task_id="99999999-0000-4000-8000-000000000000")
    clash = agent_commit(other, "a.txt", "one\nAGENT\nthree\n", "agent: line two")
    (repo / "a.txt").write_text("one\nUSER\nthree\n")
    git(repo, "commit", "-qam", "user: line two")
    before = checkout_fingerprint(repo)
    assert w.merge_plan(other, head=clash, task_id=TASK_ID) == {
        "outcome": "conflict", "paths": ["a.txt"], "detail": "runstead/99999999 kept; nothing changed in main"}
    assert checkout_fingerprint(repo) == before


def test_g7_base_dirty_and_base_missing_change_nothing(repo, tmp_path):
    info = made(repo, tmp_path)
    head = agent_commit(info, "a.txt", "one\ntwo\nthree\nagent\n", "agent: append")
    (repo / "a.txt").write_text("one\ntwo\nthree\nuser, uncommitted\n")
    before = checkout_fingerprint(repo)
    result = w.merge_plan(info, head=head, task_id=TASK_ID)
    assert (result["outcome"], result["paths"]) == ("base_dirty", ["a.txt"])
    assert checkout_fingerprint(repo) == before
    git(repo, "checkout", "-q", "-b", "other")
    git(repo, "branch", "-D", "main")
    result = w.merge_plan(info, head=head, task_id=TASK_ID)
    assert result["outcome"] == "base_missing" and "main no longer exists" in result["detail"]
    assert git(repo, "branch", "--list", "main") == ""


def test_g7_merge_into_a_base_checked_out_nowhere_moves_the_ref_by_compare_and_set(repo, tmp_path):
    info = made(repo, tmp_path)
    head = agent_commit(info, "new.txt", "new\n", "agent: add new")
    git(repo, "checkout", "-q", "-b", "elsewhere")
    before = checkout_fingerprint(repo)
    plan = w.merge_plan(info, head=head, task_id=TASK_ID)["apply"]
    assert (plan["checkout"], plan["kind"]) == (None, "fast-forward")
    meanwhile = git(repo, "commit-tree", "main^{tree}", "-p", "main", "-m", "meanwhile, elsewhere")
    git(repo, "update-ref", "refs/heads/main", meanwhile)
    assert w.merge_state(info, plan) == "moved"
    assert w.merge_apply(info, plan) == {"retry": True}  # the compare-and-set refused: plan again
    assert git(repo, "rev-parse", "main") == meanwhile
    plan = w.merge_plan(info, head=head, task_id=TASK_ID)["apply"]
    assert plan["kind"] == "merge commit"
    assert w.merge_apply(info, plan)["outcome"] == "merged"
    assert git(repo, "rev-parse", "main") == plan["target"]
    assert git(repo, "log", "-1", "--format=%P", "main") == f"{meanwhile} {head}"
    assert checkout_fingerprint(repo) == before  # the checkout on another branch never moved
