"""Worktree tasks end to end (SPEC G7, A8, W4): a real daphne, a real worker subprocess and
the test agent (tests/agents/agent.py) working in a real git repository. Each worktree
task runs on its own branch in a worktree under the worker's state directory; three of
them on one repository run at once; the user's checkout is never touched."""
import os
import subprocess
import sys
import uuid

import pytest

from tests.git_support import ENV, checkout_fingerprint, git
from tests.live import live_daphne  # noqa: F401  (fixture)
from tests.wait import wait_for
from tests.worker_harness import BASE_DIR, SHORT_TIMINGS, LiveSetup, manage_env

pytestmark = [pytest.mark.machine_side, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

PROFILES = {"wt": {"AGENT_SLEEP_S": "3"}, "wtq": {"AGENT_SLEEP_S": "0"}, "plain": {"AGENT_SLEEP_S": "0"}}
PROFILE_KEYS = {"wtq": {"isolation": "worktree"}}


@pytest.fixture
def live(live_daphne, make_owner, tmp_path):  # noqa: F811
    setup = LiveSetup(live_daphne(**SHORT_TIMINGS), make_owner(), tmp_path, profiles=PROFILES,
                      profile_keys=PROFILE_KEYS, files={"AGENT_SPANS": str(tmp_path / "spans")})
    repo = setup.repo
    git(repo, "init", "-q", "-b", "main")
    (repo / "README").write_text("hello\n")
    (repo / "sub").mkdir()
    (repo / "sub" / "x.txt").write_text("x\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "initial")
    setup.spans_file = tmp_path / "spans"
    yield setup
    setup.close()


def spans(live) -> list[tuple[float, float, str]]:
    try:
        lines = live.spans_file.read_text().splitlines()
    except FileNotFoundError:
        return []
    return [(float(a), float(b), cwd) for a, b, cwd in (line.split(" ", 2) for line in lines if line.strip())]


def test_g7_three_worktree_tasks_on_one_repository_run_at_once_and_never_touch_the_checkout(live):
    repo = live.repo
    (repo / "README").write_text("hello\nthe user's uncommitted edit\n")
    (repo / "notes.txt").write_text("the user's untracked file\n")
    before = checkout_fingerprint(repo)
    head = git(repo, "rev-parse", "HEAD")
    live.start_worker()
    ids = [live.submit("wt", isolation="worktree", prompt=f"[[write:out{i}.txt:task {i}\\n]][[commit:agent {i}]]")
           for i in range(3)]
    for task_id in ids:  # no folder lock for worktree tasks (A8 holds for each task's own branch)
        assert live.task(task_id)["holds_lock"] is False and live.task(task_id)["isolation"] == "worktree"
    wait_for(lambda: live.starts() == 3, timeout_s=60, what="three agents started")
    assert checkout_fingerprint(repo) == before  # while they run
    tasks = [live.wait_final(t, timeout=60) for t in ids]
    assert [t["state"] for t in tasks] == ["succeeded"] * 3, ([(t["state"], t["state_reason"]) for t in tasks], live.log())
    runs = spans(live)
    assert len(runs) == 3
    assert max(start for start, _, _ in runs) < min(end for _, end, _ in runs)  # all three at once
    worktrees_dir = os.path.join(live.state_dir, "worktrees")
    assert sorted(cwd for _, _, cwd in runs) == sorted(os.path.join(worktrees_dir, f) for f in os.listdir(worktrees_dir))
    for i, task in enumerate(tasks):
        g = task["evidence"]["git"]
        assert (g["branch"], g["base"], g["base_branch"], g["start_head"]) == (
            f"runstead/{task['id'][:8]}", head, "main", head)
        assert g["commits"] == 1 and g["subjects"] == [f"agent {i}"] and g["dirty"] == []
        assert git(repo, "show", f"{g['branch']}:out{i}.txt") == f"task {i}"
        assert git(repo, "rev-parse", g["branch"]) == g["end_head"]
    assert checkout_fingerprint(repo) == before  # and after
    assert not any(p.startswith("out") for p in os.listdir(repo))


def test_g7_a_folder_outside_any_git_work_tree_is_a_refused_start(live):
    plain = live.root / "plain"
    plain.mkdir()
    live.start_worker()
    task = live.wait_final(live.submit("wt", folder=plain, isolation="worktree"))
    assert task["state"] == "not_started" and live.starts() == 0
    final = [r for r in task["receipts"] if r["kind"] == "final"][0]["body"]["facts"]
    assert (final["process_started"], final["stop_reason"], final["refused_reason"]) == (
        False, "refused", "not_a_git_repository")
    assert "not inside a git work tree" in task["output_tail"]


def test_g7_the_profiles_isolation_applies_unless_the_task_says_otherwise(live):
    live.start_worker()
    wait_for(lambda: any(p["name"] == "wtq" and p["isolation"] == "worktree"
                         for p in live.api.get("/api/machines/").json()["results"][0]["profiles"]),
             what="the worker's profile report (B10)")
    by_profile = live.submit("wtq", prompt="[[write:left.txt:not committed\\n]]")
    assert live.task(by_profile)["isolation"] == "worktree" and live.task(by_profile)["holds_lock"] is False
    task = live.wait_final(by_profile)
    assert task["state"] == "succeeded"
    g = task["evidence"]["git"]
    # What the agent left uncommitted is a commit on its branch: the diff is what a merge brings.
    assert g["subjects"] == [f"RunStead task {by_profile}: work the agent left uncommitted"] and g["dirty"] == []
    assert g["files"] == [{"status": "A", "path": "left.txt", "insertions": 1, "deletions": 0}]
    assert "+not committed" in live.task(by_profile)["evidence"]["git"]["diff"]
    assert not (live.repo / "left.txt").exists()

    in_place = live.submit("wtq", isolation="none", prompt="[[write:here.txt:in place\\n]]")
    assert live.task(in_place)["isolation"] == "none" and live.task(in_place)["holds_lock"] is True
    task = live.wait_final(in_place)
    assert task["state"] == "succeeded" and (live.repo / "here.txt").read_text() == "in place\n"
    assert "branch" not in task["evidence"]["git"]
    assert spans(live)[-1][2] == str(live.repo)


def test_g7_a_subfolder_a_taken_branch_name_and_a_detached_head(live):
    task_id = live.submit("plain", folder=live.repo / "sub", isolation="worktree", prompt="[[write:y.txt:y\\n]]")
    git(live.repo, "branch", f"runstead/{task_id[:8]}")  # taken before the worker starts it
    theirs = git(live.repo, "rev-parse", f"runstead/{task_id[:8]}")
    live.start_worker()
    task = live.wait_final(task_id)
    assert task["state"] == "succeeded", live.log()
    g = task["evidence"]["git"]
    assert g["branch"] == f"runstead/{task_id}"  # never moved someone else's branch
    assert git(live.repo, "rev-parse", f"runstead/{task_id[:8]}") == theirs
    assert spans(live)[-1][2].endswith("/sub")  # the task folder's place in the worktree
    assert g["files"][0]["path"] == "sub/y.txt"

    git(live.repo, "checkout", "-q", "--detach")
    task = live.wait_final(live.submit("plain", isolation="worktree", prompt="[[write:z.txt:z\\n]]"))
    assert task["state"] == "succeeded"
    assert task["evidence"]["git"]["base_branch"] is None
    assert subprocess.run(["git", "-C", str(live.repo), "symbolic-ref", "-q", "HEAD"], env=ENV).returncode == 1


def test_g7_x3_a_restarted_worker_reports_the_worktrees_branch_and_diff(live):
    first = live.start_worker(fault="while_agent_runs")
    task_id = live.submit("wt", isolation="worktree", prompt="[[write:half.txt:half done\\n]]")
    assert first.wait(timeout=60) == 97, live.log()
    live.start_worker()
    task = live.wait_final(task_id, timeout=60)
    assert task["stop_reason"] in ("worker_restart", "exit") and live.starts() == 1  # X3: stopped, or it had ended
    assert "unknown" in [r["kind"] for r in task["receipts"]]  # reported by the restarted worker
    g = task["evidence"]["git"]
    assert g["branch"] == f"runstead/{task_id[:8]}" and g["files"][0]["path"] == "half.txt"
    assert git(live.repo, "show", f"{g['branch']}:half.txt") == "half done"  # left uncommitted, now on the branch


# --- merge or discard, once (the worker's side) ------------------------------------------


def decide(live, task_id: str, action: str, key: str | None = None):
    return live.api.post(f"/api/tasks/{task_id}/integrate/", json={"action": action},
                         headers={"Idempotency-Key": key or str(uuid.uuid4())})


def outcome_of(live, task_id: str, timeout: float = 30) -> dict:
    task = wait_for(lambda: (t := live.task(task_id))["integration"] and t["integration"]["outcome"] and t,
                    timeout_s=timeout, what=f"the integration outcome of {task_id}")
    return task["integration"]


def worktree_task(live, prompt: str) -> dict:
    task = live.wait_final(live.submit("plain", isolation="worktree", prompt=prompt), timeout=60)
    assert task["state"] == "succeeded", live.log()
    return task


def test_g7_merge_fast_forwards_the_base_in_the_users_checkout_and_removes_worktree_and_branch(live):
    live.start_worker()
    (live.repo / "notes.txt").write_text("the user's own untracked file\n")
    task = worktree_task(live, "[[write:feature.txt:new feature\\n]][[commit:agent: add the feature]]")
    g = task["evidence"]["git"]
    answer = decide(live, task["id"], "merge", key="merge-it")
    assert answer.status_code == 202, answer.text
    assert decide(live, task["id"], "merge", key="merge-it").content == answer.content  # a double tap replays
    assert decide(live, task["id"], "discard").json()["error"] == "already_decided"
    integration = outcome_of(live, task["id"])
    assert (integration["outcome"], integration["commit"]) == ("merged", g["end_head"])
    assert git(live.repo, "rev-parse", "main") == g["end_head"]
    assert (live.repo / "feature.txt").read_text() == "new feature\n"  # in the user's checkout, which follows main
    assert git(live.repo, "status", "--porcelain") == "?? notes.txt"
    assert os.listdir(live.state_dir / "worktrees") == []
    assert git(live.repo, "branch", "--list", "runstead/*") == ""
    assert "worktree and branch" in integration["detail"]

    # W3: the integrate message delivered again (as if the ack were lost) is acknowledged
    # and recognised: nothing is merged again, no second outcome is reported.
    from django.utils import timezone

    from tasks_app.models import OutboxMessage

    message = OutboxMessage.objects.get(operation__task_id=task["id"], kind="integrate")
    OutboxMessage.objects.filter(pk=message.pk).update(acked_at=None, visible_at=timezone.now())
    wait_for(lambda: OutboxMessage.objects.get(pk=message.pk).acked_at is not None, what="the redelivery's ack")
    assert OutboxMessage.objects.get(pk=message.pk).deliveries == message.deliveries + 1
    assert git(live.repo, "rev-parse", "main") == g["end_head"]
    assert [r["kind"] for r in live.task(task["id"])["receipts"]].count("integrated") == 1
    assert "already known" in live.log()


def test_g7_a_second_task_editing_the_same_line_conflicts_and_leaves_both_checkouts_clean(live):
    live.start_worker()
    first = worktree_task(live, "[[write:README:hello from task one\\n]][[commit:one]]")
    second = worktree_task(live, "[[write:README:hello from task two\\n]][[commit:two]]")
    decide(live, first["id"], "merge")
    assert outcome_of(live, first["id"])["outcome"] == "merged"
    before = checkout_fingerprint(live.repo)
    decide(live, second["id"], "merge")
    integration = outcome_of(live, second["id"])
    assert (integration["outcome"], integration["paths"], integration["commit"]) == ("conflict", ["README"], None)
    assert checkout_fingerprint(live.repo) == before  # nothing half-merged, nothing to abort
    assert git(live.repo, "status", "--porcelain") == ""
    branch = second["evidence"]["git"]["branch"]
    worktree = os.path.join(live.state_dir, "worktrees", os.listdir(live.state_dir / "worktrees")[0])
    assert git(worktree, "status", "--porcelain") == "" and git(live.repo, "rev-parse", branch) == \
        second["evidence"]["git"]["end_head"]  # the branch stays for the owner
    pruned = subprocess.run([sys.executable, "manage.py", "worker", "--prune-worktrees", "--state-dir",
                             str(live.state_dir)], cwd=BASE_DIR, env=manage_env(), capture_output=True, text=True,
                            timeout=60)
    assert pruned.returncode == 0, pruned.stderr
    assert f"removed worktree {worktree}" in pruned.stdout and f"kept branch {branch}" in pruned.stdout
    assert not os.path.exists(worktree) and git(live.repo, "branch", "--list", branch) == branch


def test_g7_base_dirty_changes_nothing_and_discard_removes_the_branch(live):
    live.start_worker()
    task = worktree_task(live, "[[write:README:hello, agent\\n]][[commit:agent]]")
    (live.repo / "README").write_text("hello, the user's uncommitted edit\n")
    before = checkout_fingerprint(live.repo)
    decide(live, task["id"], "merge")
    integration = outcome_of(live, task["id"])
    assert (integration["outcome"], integration["paths"]) == ("base_dirty", ["README"])
    assert checkout_fingerprint(live.repo) == before
    other = worktree_task(live, "[[write:junk.txt:junk\\n]][[commit:junk]]")
    decide(live, other["id"], "discard")
    assert outcome_of(live, other["id"])["outcome"] == "discarded"
    assert git(live.repo, "branch", "--list", other["evidence"]["git"]["branch"]) == ""
    assert checkout_fingerprint(live.repo) == before


@pytest.mark.parametrize("point", ["integrate_after_plan_before_merge", "integrate_after_merge_before_receipt"])
def test_g7_a_worker_killed_mid_merge_restarts_and_reports_the_true_outcome_never_merging_twice(live, point):
    """The worker dies (os._exit, as kill -9) with the base's move recorded but not made,
    or made but not reported. The restarted worker asks git where the base stands and
    reports ``merged`` with the one merge commit."""
    first = live.start_worker(fault=point)
    task = worktree_task(live, "[[write:feature.txt:feature\\n]][[commit:agent: feature]]")
    git(live.repo, "commit", "-q", "--allow-empty", "-m", "user: meanwhile")  # so the merge makes a merge commit
    base = git(live.repo, "rev-parse", "main")
    decide(live, task["id"], "merge")
    assert first.wait(timeout=60) == 97, live.log()
    moved = git(live.repo, "rev-parse", "main")
    assert (moved == base) == (point == "integrate_after_plan_before_merge")
    assert live.task(task["id"])["integration"]["outcome"] is None
    live.start_worker()
    integration = outcome_of(live, task["id"])
    assert integration["outcome"] == "merged"
    head = git(live.repo, "rev-parse", "main")
    assert integration["commit"] == head and git(live.repo, "log", "-1", "--format=%P", "main") == \
        f"{base} {task['evidence']['git']['end_head']}"
    assert git(live.repo, "rev-list", "--count", "--merges", "main") == "1"  # one merge, never two
    assert (live.repo / "feature.txt").read_text() == "feature\n"
    assert git(live.repo, "status", "--porcelain") == ""
    receipts = [r for r in live.task(task["id"])["receipts"] if r["kind"] == "integrated"]
    assert len(receipts) == 1
