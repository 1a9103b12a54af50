"""Worktree tasks with the real Claude Code CLI (SPEC G7): the pinned CLI, offline against
the fake Messages API of tests/claude_cli.py, runs in its task's worktree through a real
worker and a real daphne. Its Bash tool call writes a file and commits it on the task's
branch; merge lands it on the base branch; a second task that edited the same line
conflicts, and both checkouts stay clean."""
import os

import pytest

from tests.claude_cli import fake_model_api, write_claude_profile  # noqa: F401  (fixture)
from tests.git_support import checkout_fingerprint, git
from tests.live import live_daphne  # noqa: F401  (fixture)
from tests.wait import wait_for
from tests.worker_harness import SHORT_TIMINGS, LiveSetup

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

COMMIT = "git add -A && git -c user.name=claude -c user.email=claude@example.com commit -qm"


@pytest.fixture
def real_claude(live_daphne, make_owner, tmp_path, fake_model_api):  # noqa: F811
    setup = LiveSetup(live_daphne(**SHORT_TIMINGS), make_owner(), tmp_path)
    git(setup.repo, "init", "-q", "-b", "main")
    (setup.repo / "shared.txt").write_text("first line\nthe line both tasks edit\nlast line\n")
    git(setup.repo, "add", "-A")
    git(setup.repo, "commit", "-qm", "initial")
    write_claude_profile(setup, api=fake_model_api, home=tmp_path / "home",
                         options='isolation = "worktree"\nextra_args = ["--permission-mode", "bypassPermissions"]\n')
    setup.start_worker()
    yield setup
    setup.close()


def run_claude(live, command: str) -> dict:
    task = live.wait_final(live.submit("claude", prompt=f"[[bash:{command}]]"), timeout=120)
    assert task["state"] == "succeeded", (task["state_reason"], task["output_tail"][-2000:], live.log())
    return task


def merge(live, task_id: str) -> dict:
    answer = live.api.post(f"/api/tasks/{task_id}/integrate/", json={"action": "merge"},
                           headers={"Idempotency-Key": f"merge-{task_id}"})
    assert answer.status_code == 202, answer.text
    task = wait_for(lambda: (t := live.task(task_id))["integration"]["outcome"] and t, timeout_s=60,
                    what=f"the merge outcome\n{live.log()}")
    return task["integration"]


def test_g7_real_claude_changes_a_file_on_its_branch_merge_lands_it_a_second_edit_of_the_line_conflicts(real_claude):
    live = real_claude
    wait_for(lambda: any(p.get("isolation") == "worktree"
                         for p in live.api.get("/api/machines/").json()["results"][0]["profiles"]),
             what="the worker's profiles (B10)")
    before = checkout_fingerprint(live.repo)
    one = run_claude(live, "sed -i 's/the line both tasks edit/edited by task one/' shared.txt && "
                           f"echo 'made by claude' > made.txt && {COMMIT} 'claude: task one'")
    two = run_claude(live, f"sed -i 's/the line both tasks edit/edited by task two/' shared.txt && {COMMIT} 'claude: two'")
    assert checkout_fingerprint(live.repo) == before  # both ran beside the checkout, not in it
    g1, g2 = one["evidence"]["git"], two["evidence"]["git"]
    assert g1["branch"] == f"runstead/{one['id'][:8]}" and g1["subjects"] == ["claude: task one"]
    assert sorted(f["path"] for f in g1["files"]) == ["made.txt", "shared.txt"]
    assert "+edited by task one" in g1["diff"] and "-the line both tasks edit" in g1["diff"]
    assert one["usage"]["tool_calls"] == 1 and one["agent_result"]["is_error"] is False

    first = merge(live, one["id"])
    assert (first["outcome"], first["commit"]) == ("merged", g1["end_head"])  # main had not moved: a fast-forward
    assert git(live.repo, "rev-parse", "main") == g1["end_head"]
    assert (live.repo / "made.txt").read_text() == "made by claude\n"
    assert "edited by task one" in (live.repo / "shared.txt").read_text()
    assert git(live.repo, "status", "--porcelain") == ""

    merged = checkout_fingerprint(live.repo)
    second = merge(live, two["id"])
    assert (second["outcome"], second["paths"], second["commit"]) == ("conflict", ["shared.txt"], None)
    assert checkout_fingerprint(live.repo) == merged and git(live.repo, "status", "--porcelain") == ""
    worktree = os.path.join(live.state_dir, "worktrees", os.listdir(live.state_dir / "worktrees")[0])
    assert git(worktree, "status", "--porcelain") == ""  # the task's checkout is clean too
    assert git(live.repo, "rev-parse", g2["branch"]) == g2["end_head"]  # and its branch stays for the owner
