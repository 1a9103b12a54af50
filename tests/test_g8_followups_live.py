"""Queued follow-ups through a real worker (SPEC G8, G6, G7, O4): a real daphne, a real
worker subprocess and scripts/fake_claude.py as ``claude`` (Claude Code's stream-json; a
tool call that commits in its working directory; each run's argv and cwd recorded). A
follow-up sent while a worktree task runs is queued, starts only once the first is final,
resumes the first's agent session (``--resume``) in the same worktree, on the same branch;
``manage.py submit_task --continue TASK --isolation worktree`` sends the next one; one merge
brings the branch's whole work to the base branch, and the user's checkout is untouched
until then."""
import json
import subprocess
import sys
import uuid
from datetime import datetime
from pathlib import Path

import pytest

from tests.git_support import checkout_fingerprint, git
from tests.live import module_daphne  # noqa: F401  (fixture)
from tests.wait import wait_for
from tests.worker_harness import BASE_DIR, SHORT_TIMINGS, LiveSetup, manage_env

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

FAKE_CLAUDE = Path(__file__).resolve().parent.parent / "scripts" / "fake_claude.py"


@pytest.fixture
def live(module_daphne, transactional_db, make_owner, tmp_path):  # noqa: F811
    setup = LiveSetup(module_daphne(**SHORT_TIMINGS), make_owner(), tmp_path)
    git(setup.repo, "init", "-q", "-b", "main")
    (setup.repo / "README").write_text("hello\n")
    git(setup.repo, "add", "-A")
    git(setup.repo, "commit", "-qm", "initial")
    setup.record = tmp_path / "claude-runs.jsonl"
    common = f'FAKE_CLAUDE_RECORD = "{setup.record}", FAKE_CLAUDE_TURNS = "3"'
    setup.config.write_text(
        f'allowed_roots = ["{setup.root}"]\n'
        f'[profiles.claude]\npreset = "claude"\nbinary = "{FAKE_CLAUDE}"\n'
        f'env = {{ {common}, FAKE_CLAUDE_PAUSE_S = "0.2" }}\n'
        # The first task's events come slowly enough for a follow-up to arrive while it runs;
        # the test still waits for the fact (running) before sending it.
        f'[profiles.claude-slow]\npreset = "claude"\nbinary = "{FAKE_CLAUDE}"\n'
        f'env = {{ {common}, FAKE_CLAUDE_PAUSE_S = "0.8" }}\n')
    setup.start_worker()
    yield setup
    setup.close()


def runs(live) -> list[dict]:
    try:
        return [json.loads(line) for line in live.record.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return []


def at(iso: str) -> datetime:
    return datetime.fromisoformat(iso)


def test_g8_g7_a_follow_up_queued_while_a_worktree_task_runs_resumes_its_session_in_the_same_worktree(live):
    repo = live.repo
    before = checkout_fingerprint(repo)
    first = live.submit("claude-slow", isolation="worktree", prompt="write the notes")
    live.wait_state(first, "running", timeout=60)
    resp = live.api.post("/api/tasks/", headers={"Idempotency-Key": str(uuid.uuid4())}, json={
        "machine": live.machine_id, "folder": str(repo), "agent": "claude", "prompt": "and now the summary",
        "continue_task": first})
    assert resp.status_code == 201, resp.text
    follow = resp.json()
    assert (follow["state"], follow["queued_behind"], follow["isolation"]) == ("queued", first, "worktree")
    wait_for(lambda: len(runs(live)) >= 1, timeout_s=30, what="the first run recorded")
    assert len(runs(live)) == 1  # nothing started for the follow-up while the first runs

    done_first = live.wait_final(first, timeout=90)
    done_follow = live.wait_final(follow["id"], timeout=90)
    assert (done_first["state"], done_follow["state"]) == ("succeeded", "succeeded"), live.log()
    events = done_follow["events"]
    assert [e["new_state"] for e in events][:2] == ["queued", "accepted"]
    assert at(events[1]["at"]) >= at(done_first["final_at"])  # its start only once the first was final

    one, two = runs(live)
    session = done_first["agent_session_id"]
    assert session and "--resume" not in one["argv"]
    assert two["argv"][two["argv"].index("--resume") + 1] == session  # G6: the first's session
    assert two["cwd"] == one["cwd"] and one["cwd"].startswith(str(live.state_dir / "worktrees"))  # same worktree
    g1, g2 = done_first["evidence"]["git"], done_follow["evidence"]["git"]
    branch = f"runstead/{first[:8]}"
    assert g1["branch"] == g2["branch"] == branch and g1["base"] == g2["base"]
    # G5 counts its own commits, made on top of the first's.
    assert g2["start_head"] == g1["end_head"] and g2["commits"] >= 1
    assert all("and now the summary" in subject for subject in g2["subjects"])
    assert [f["path"] for f in g2["files"]] == ["NOTES.md"] and "and now the summary" in g2["diff"]
    assert "write the notes" in g2["diff"]  # the diff against the base holds both runs' work
    assert checkout_fingerprint(repo) == before  # the user's checkout, untouched

    # O4: the terminal sends the next one on the same branch and follows it to its end.
    done = subprocess.run(
        [sys.executable, "manage.py", "submit_task", "--server", live.url, "--token", live.owner.auth_token.key,
         "--machine", live.machine_id, "--folder", str(repo), "--continue", follow["id"],  # no --agent: the task's
         "--isolation", "worktree", "--follow", "--json", "the last touch"],
        cwd=BASE_DIR, env=manage_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (done.stdout, done.stderr, live.log())
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    third = lines[0]
    assert (third["continue_task"], third["isolation"], third["agent"]) == (follow["id"], "worktree", follow["agent"])
    assert lines[-1]["type"] == "final" and lines[-1]["task"]["state"] == "succeeded"
    three = runs(live)[2]
    assert three["cwd"] == one["cwd"] and three["argv"][three["argv"].index("--resume") + 1] == session
    g3 = live.task(third["id"])["evidence"]["git"]
    assert g3["branch"] == branch and g3["start_head"] == g2["end_head"]

    # One decision for the branch, on its latest task: the merge brings all three runs.
    refused = live.api.post(f"/api/tasks/{first}/integrate/", json={"action": "merge"},
                            headers={"Idempotency-Key": str(uuid.uuid4())})
    assert (refused.status_code, refused.json()["error"]) == (409, "superseded")
    merged = live.api.post(f"/api/tasks/{third['id']}/integrate/", json={"action": "merge"},
                           headers={"Idempotency-Key": str(uuid.uuid4())})
    assert merged.status_code == 202, merged.text
    wait_for(lambda: (live.task(third["id"])["integration"] or {}).get("outcome") == "merged", timeout_s=60,
             what="the merge reported")
    notes = git(repo, "show", "main:NOTES.md")
    assert all(text in notes for text in ("write the notes", "and now the summary", "the last touch"))
    assert git(repo, "rev-parse", "main") == g3["end_head"]  # a fast-forward to the reviewed commit
