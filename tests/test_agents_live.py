"""Real agent CLIs' path end to end (SPEC G1-G6): a real daphne, a real worker
subprocess, and fake CLIs on the worker's PATH: ``claude`` is scripts/fake_claude.py
(Claude Code's stream-json, a tool call that commits in the repository), steered by its
environment. Board events are read from a real ``/ws/board/`` socket.
"""
import json
import os
import subprocess
import uuid
from pathlib import Path

import pytest

from tests.live import BoardSocket, module_daphne  # noqa: F401  (fixture)
from tests.wait import wait_for
from tests.worker_harness import SHORT_TIMINGS, LiveSetup

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

BASE_DIR = Path(__file__).resolve().parent.parent
FAKE_CLAUDE = BASE_DIR / "scripts" / "fake_claude.py"


def git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@e", *args],
                          check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def agents(module_daphne, transactional_db, make_owner, tmp_path):  # noqa: F811
    """A paired worker whose config has preset profiles and whose PATH has a fake
    ``claude`` (and no ``gemini``)."""
    setup = LiveSetup(module_daphne(**SHORT_TIMINGS), make_owner(), tmp_path)
    git(setup.repo, "init", "-q")
    (setup.repo / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    git(setup.repo, "add", "calc.py")
    git(setup.repo, "commit", "-qm", "start")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "claude").symlink_to(FAKE_CLAUDE)
    setup.record = tmp_path / "claude-argv.jsonl"
    common = f'FAKE_CLAUDE_RECORD = "{setup.record}", FAKE_CLAUDE_PAUSE_S = "0.2"'
    setup.config.write_text(
        f'allowed_roots = ["{setup.root}"]\n'
        '[profiles.claude]\npreset = "claude"\n'
        f'env = {{ {common} }}\n'
        '[profiles.claude-slow]\npreset = "claude"\n'
        f'env = {{ {common.replace("0.2", "0.6")}, FAKE_CLAUDE_TURNS = "6", FAKE_CLAUDE_COMMIT = "0" }}\n'
        '[profiles.claude-error]\npreset = "claude"\n'
        f'env = {{ {common}, FAKE_CLAUDE_RESULT = "api_error" }}\n'
        '[profiles.gemini]\npreset = "gemini"\n'
        f'[profiles.aider]\npreset = "aider"\nbinary = "{FAKE_CLAUDE}"\n'
    )
    setup.start_worker(env={"PATH": f"{bindir}:{os.environ['PATH']}"})
    yield setup
    setup.close()


@pytest.mark.machine_side
def test_g3_success_carries_usage_session_and_git_evidence(agents):
    start_head = git(agents.repo, "rev-parse", "HEAD")
    task_id = agents.submit("claude", prompt="fix the failing test")
    task = agents.wait_final(task_id, timeout=40)
    assert task["state"] == "succeeded", task
    assert task["agent_result"] == {"is_error": False, "subtype": "success",
                                    "summary": "Done: 'fix the failing test' is handled; I committed my notes."}
    usage = task["usage"]
    assert (usage["turns"], usage["tool_calls"]) == (3, 2)
    assert usage["input_tokens"] > 0 and usage["output_tokens"] > 0 and usage["cost_usd"] > 0
    assert uuid.UUID(task["agent_session_id"])
    evidence = task["evidence"]["git"]
    assert evidence["start_head"] == start_head and evidence["end_head"] == git(agents.repo, "rev-parse", "HEAD")
    assert evidence["commits"] == 2 and len(evidence["subjects"]) == 2
    assert (evidence["files_changed"], evidence["dirty"]) == (1, [])
    assert task["progress"] is not None  # the last progress stays on the task


@pytest.mark.machine_side
def test_g3_exit_zero_with_is_error_is_failed(agents):
    task = agents.wait_final(agents.submit("claude-error"), timeout=30)
    assert (task["state"], task["exit_code"]) == ("failed", 0)
    assert task["state_reason"] == "agent reported api_error"
    assert task["agent_result"]["is_error"] is True


@pytest.mark.machine_side
def test_g1_missing_binary_is_a_refused_start_agent_not_found(agents):
    task = agents.wait_final(agents.submit("gemini"), timeout=20)
    assert task["state"] == "not_started"
    final = next(r for r in task["receipts"] if r["kind"] == "final")
    assert final["body"]["facts"]["process_started"] is False
    assert final["body"]["facts"]["refused_reason"] == "agent_not_found"
    assert "gemini" in task["output_tail"] and "not found" in task["output_tail"]
    assert "agent_not_found" in task["state_reason"]


def test_g4_live_progress_reaches_the_board_while_running(agents):
    board = BoardSocket(agents.url, agents.owner.auth_token.key)
    board.start()
    assert board.connected.wait(10)
    try:
        task_id = agents.submit("claude-slow", prompt="watch me")
        task = agents.wait_final(task_id, timeout=40)
        final_at = wait_for(lambda: next((e["_seen"] for e in list(board.events) if e.get("type") == "task"
                                          and e["task"]["id"] == task_id and e["task"]["state"] == "succeeded"), None),
                            what="the board's succeeded event")
    finally:
        board.stop()
    assert task["state"] == "succeeded"
    progress = [e for e in board.events if e.get("type") == "task.progress" and e["task_id"] == task_id]
    during = [e for e in progress if e["_seen"] < final_at]
    assert len(during) >= 3, progress
    seqs = [e["progress"]["seq"] for e in during]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    turns = [e["progress"]["usage"]["turns"] for e in during]
    assert turns == sorted(turns) and turns[-1] > turns[0]  # turns rise while it works
    assert any("Turn" in (e["progress"]["last_message"] or "") for e in during)
    versions = [e["version"] for e in during]
    assert versions == sorted(versions)
    # G4: at most once a second over the run (the exact pacing is checked at the worker,
    # tests/test_agent_progress_worker.py; arrival times here carry the service's jitter)
    assert len(progress) <= int(task["runtime_s"]) + 1, (len(progress), task["runtime_s"])


@pytest.mark.machine_side
def test_g6_follow_up_passes_the_session_id_to_resume(agents):
    first = agents.wait_final(agents.submit("claude", prompt="first"), timeout=40)
    assert first["state"] == "succeeded"
    session = first["agent_session_id"]
    resp = agents.api.post("/api/tasks/", json={"machine": agents.machine_id, "folder": str(agents.repo),
                                                "agent": "claude", "prompt": "and the docs",
                                                "continue_task": first["id"]},
                           headers={"Idempotency-Key": str(uuid.uuid4())})
    assert resp.status_code == 201, resp.text
    second = agents.wait_final(resp.json()["id"], timeout=40)
    assert second["state"] == "succeeded"
    assert second["agent_session_id"] == session
    argv = json.loads(agents.record.read_text().splitlines()[-1])["argv"]
    assert argv[argv.index("--resume") + 1] == session
    assert argv[-2:] == ["--", "and the docs"]


@pytest.mark.machine_side
def test_g6_profile_that_cannot_resume_refuses_resume_unsupported(agents):
    first = agents.wait_final(agents.submit("claude", prompt="first"), timeout=40)
    resp = agents.api.post("/api/tasks/", json={"machine": agents.machine_id, "folder": str(agents.repo),
                                                "agent": "aider", "prompt": "go on", "continue_task": first["id"]},
                           headers={"Idempotency-Key": str(uuid.uuid4())})
    assert resp.status_code == 201, resp.text
    task = agents.wait_final(resp.json()["id"], timeout=20)
    assert task["state"] == "not_started"
    final = next(r for r in task["receipts"] if r["kind"] == "final")
    assert final["body"]["facts"]["refused_reason"] == "resume_unsupported"


@pytest.mark.machine_side
def test_c2_c4_c5_the_demo_stand_in_holds_a_live_conversation(agents):
    """The demo's ``fake-claude`` profile (the claude preset, so a live conversation)
    speaks stream-json input too: two messages answered one turn each in one process, an
    interrupt ends a running turn, end closes its input and the task succeeds."""
    from tests.conversation_support import messages, op_dir, send, wait_live_profile, wait_states

    wait_live_profile(agents)
    task_id = agents.submit("claude-slow", prompt="first", mode="conversation")
    wait_states(agents, task_id, {0: "delivered"}, timeout=30)
    assert agents.api.post(f"/api/tasks/{task_id}/interrupt/").status_code == 202
    wait_states(agents, task_id, {0: "answered"}, timeout=30)
    assert send(agents, task_id, "second").status_code == 201
    wait_states(agents, task_id, {1: "answered"}, timeout=30)
    assert agents.api.post(f"/api/tasks/{task_id}/end/").status_code == 200
    task = agents.wait_final(task_id, timeout=30)
    assert task["state"] == "succeeded", (task["state_reason"], task["output_tail"])
    assert [m["state"] for m in messages(agents, task_id)] == ["answered", "answered"]
    assert task["agent_result"]["summary"].startswith("Done: 'second'")
    [run] = [json.loads(line) for line in agents.record.read_text().splitlines()]  # one process
    assert run["stdin"] == ""
    with open(os.path.join(op_dir(agents, task_id), "output.log")) as f:
        results = [json.loads(line)["subtype"] for line in f if '"type": "result"' in line]
    assert results == ["error_during_execution", "success"]  # the first turn was interrupted
