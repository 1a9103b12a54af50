"""Q5, Q8, W5: a headless task with ``approvals = "ask"``, proven with the real Claude Code.

The pinned CLI runs offline against the fake Messages API (tests/claude_cli.py) through a
real worker and a real daphne, in ``--permission-mode default`` (so its Bash call needs
permission). The worker adds the ``PermissionRequest`` hook for the run only
(``--settings``) and puts the task's approval credential in the agent's environment; the
hook asks the service and waits. The owner answers through the API, as the board does:

- allow: the task stays ``running`` with ``attention: approval`` (JSON and board events)
  while its lease renews, the tool runs, the task succeeds; the credential is nowhere it
  must not be (daphne's and the worker's logs, the board's events and pages, the worker's
  database), and the agent's environment holds no owner or machine token;
- deny with a message: the agent's next model request carries the words as the tool
  result;
- no answer: the approval expires after ``approval_wait_s`` and the task ends by its
  own facts.
"""
import json
import shlex
import time
import uuid
from datetime import datetime

import pytest

from machine.worker.store import DB_NAME
from tests.claude_cli import fake_model_api, write_claude_profile  # noqa: F401  (fixture)
from tests.live import BoardSocket, module_daphne  # noqa: F401  (fixture)
from tests.wait import wait_for
from tests.worker_harness import SHORT_TIMINGS, LiveSetup

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

WAIT_S = "60"  # approval_wait_s of the answered tests
SHORT_WAIT_S = "1.5"  # approval_wait_s of the unanswered one
DENY_WORDS = "Not on this machine: use the staging database instead."


def setup_for(url, make_owner, tmp_path, api) -> LiveSetup:
    setup = LiveSetup(url, make_owner(), tmp_path)
    write_claude_profile(setup, api=api, home=tmp_path / "home",
                         options='approvals = "ask"\nextra_args = ["--permission-mode", "default"]\n')
    setup.start_worker()
    return setup


@pytest.fixture
def asking(module_daphne, make_owner, tmp_path, fake_model_api):  # noqa: F811
    """``asking(approval_wait_s) -> LiveSetup`` with a worker running the real CLI."""
    setups = []

    def make(wait_s: str = WAIT_S) -> LiveSetup:
        url = module_daphne(**SHORT_TIMINGS, RUNSTEAD_APPROVAL_WAIT_S=wait_s, RUNSTEAD_LOG_LEVEL="DEBUG")
        setups.append(setup_for(url, make_owner, tmp_path, fake_model_api))
        return setups[-1]

    yield make
    for setup in setups:
        setup.close()


def pending_approval(setup: LiveSetup, task_id: str, timeout: float = 60.0) -> dict:
    found = []

    def asked():
        found[:] = setup.api.get("/api/approvals/", params={"task": task_id}).json()["results"]
        return bool(found)

    wait_for(asked, timeout_s=timeout, what=f"the task's approval\n{setup.log()}")
    return found[0]


def decide(setup: LiveSetup, approval_id: str, **body):
    answer = setup.api.post(f"/api/approvals/{approval_id}/decision/", json=body,
                            headers={"Idempotency-Key": str(uuid.uuid4())})
    assert answer.status_code == 200, answer.text
    return answer.json()


def tool_results(api) -> list[dict]:
    """Every tool_result block the CLI sent to the fake model, in order."""
    return [block for path, body in api.requests if path.startswith("/v1/messages")
            for message in body.get("messages") or [] if message.get("role") == "user"
            and isinstance(message.get("content"), list)
            for block in message["content"] if block.get("type") == "tool_result"]


def test_q5_q8_allowed_from_the_api_the_tool_runs_and_the_task_succeeds(asking, fake_model_api, module_daphne):  # noqa: F811
    from tasks_app.models import Lease

    setup = asking()
    board = BoardSocket(setup.url, setup.owner.auth_token.key)
    board.start()
    assert board.connected.wait(10)
    try:
        task_id = setup.submit("claude", prompt="[[bash:env > agent-env.txt && echo allowed > allowed.txt]]")
        approval = pending_approval(setup, task_id)
        assert (approval["state"], approval["tool_name"], approval["agent"]) == ("pending", "Bash", "claude")
        assert approval["tool_input"]["command"].startswith("env > agent-env.txt")
        task = setup.task(task_id)
        assert (task["state"], task["attention"]) == ("running", "approval")
        assert task["approvals"] == {"asked": 1, "allowed": 0, "denied": 0}
        wait_for(lambda: any(e.get("type") == "task" and e["task"]["id"] == task_id
                             and e["task"]["attention"] == "approval" for e in list(board.events)),
                 what="a task event with attention approval")
        # While it waits, the lease keeps renewing (3 s leases): renewed well after the ask, still running.
        asked_at = datetime.fromisoformat(approval["created_at"])
        wait_for(lambda: (Lease.objects.get(task_id=task_id).expires_at - asked_at).total_seconds() > 4.5,
                 timeout_s=30, what="a renewal 1.5 s after the approval was asked")
        task = setup.task(task_id)
        assert (task["state"], task["attention"]) == ("running", "approval")
        assert not (setup.repo / "allowed.txt").exists()

        requests_before = len(fake_model_api.requests)
        decided_at = time.monotonic()
        decide(setup, approval["id"], behavior="allow")
        wait_for(lambda: len(tool_results(fake_model_api)) >= 1, timeout_s=30, what="the tool's result")
        reached_s = time.monotonic() - decided_at
        print(f"Q5: from the owner's answer to the agent's next model request: {reached_s:.2f} s")
        assert len(fake_model_api.requests) > requests_before
        task = setup.wait_final(task_id, timeout=60)
        assert task["state"] == "succeeded", task
        assert (setup.repo / "allowed.txt").read_text() == "allowed\n"
        assert tool_results(fake_model_api)[0].get("is_error") in (None, False)
        assert task["approvals"] == {"asked": 1, "allowed": 1, "denied": 0} and task["attention"] == ""
        # The owner's answer reached the agent, and its tool ran, within a few seconds (Q5: 2 s to the hook).
        assert reached_s < 6, reached_s
    finally:
        board.stop()

    # W5: the agent's environment has its task's credential, never an owner or machine token.
    env = dict(line.split("=", 1) for line in (setup.repo / "agent-env.txt").read_text().splitlines() if "=" in line)
    credential = env["RUNSTEAD_TASK_CREDENTIAL"]
    assert env["RUNSTEAD_TASK_ID"] == task_id and env["RUNSTEAD_TASK_SERVER"] == setup.url
    machine_token = (setup.state_dir / "token").read_text().strip()
    dump = json.dumps(env)
    assert setup.owner.auth_token.key not in dump and machine_token not in dump
    # ... and its credential stopped when the task ended.
    import httpx

    refused = httpx.get(f"{setup.url}/api/approvals/{approval['id']}/", headers={"Authorization": f"Task {credential}"})
    assert refused.status_code == 401
    # Q7, K1: the credential is in no log, event, page or local database.
    from django.test import Client

    browser = Client()
    browser.force_login(setup.owner)
    server = next(s for s in module_daphne.servers.values() if s.url == setup.url)
    places = {
        "daphne log": server.log(),
        "worker log": setup.log_path.read_text(errors="replace"),
        "board events": json.dumps(board.events),
        "task": json.dumps(setup.task(task_id)),
        "board page": browser.get("/").content.decode(),
        "task page": browser.get(f"/tasks/{task_id}/").content.decode(),
        "task page data": browser.get(f"/tasks/{task_id}/data/").content.decode(),
        "worker database": b"".join(p.read_bytes() for p in setup.state_dir.glob(f"{DB_NAME}*")).decode(errors="replace"),
        "approvals": setup.api.get("/api/approvals/", params={"task": task_id}).text,
    }
    assert places["daphne log"] and places["worker database"]
    assert [where for where, text in places.items() if credential in text] == []


def test_q5_q8_denied_with_a_message_the_agent_reads_it_as_the_tool_result(asking, fake_model_api, tmp_path):  # noqa: F811
    """Also: the owner's own ``install_hooks`` entry runs beside the run's and stays out
    of it (inside a task only the run's ``--task`` entry asks): one approval."""
    from machine.hooks.install import hook_argv

    setup = asking()
    user_hook = {"type": "command", "command": shlex.join(hook_argv("claude", tmp_path / "user-hooks")), "timeout": 630}
    (tmp_path / "home" / ".claude" / "settings.json").write_text(json.dumps(
        {"hooks": {"PermissionRequest": [{"matcher": "*", "hooks": [user_hook]}]}}))
    task_id = setup.submit("claude", prompt="[[bash:echo nope > denied.txt]]")
    approval = pending_approval(setup, task_id)
    decide(setup, approval["id"], behavior="deny", message=DENY_WORDS)
    task = setup.wait_final(task_id, timeout=60)
    results = tool_results(fake_model_api)
    assert [(r["content"], r.get("is_error")) for r in results] == [(DENY_WORDS, True)]
    assert not (setup.repo / "denied.txt").exists()
    # The agent went on and ended by its own facts: its final answer, no error.
    assert task["state"] == "succeeded" and task["agent_result"]["is_error"] is False, task
    assert task["approvals"] == {"asked": 1, "allowed": 0, "denied": 1}
    assert len(setup.api.get("/api/approvals/", params={"task": task_id}).json()["results"]) == 1
    assert not (tmp_path / "user-hooks" / "outbox.sqlite3").exists()  # the owner's interactive setup untouched
    denied = setup.api.get(f"/api/approvals/{approval['id']}/").json()
    assert (denied["state"], denied["message"], denied["decided_by"]) == ("denied", DENY_WORDS, "owner:" + setup.owner.username)


def test_q5_q8_no_answer_expires_and_the_task_ends_by_its_facts(asking, fake_model_api):  # noqa: F811
    from tasks_app.models import TaskEvent

    setup = asking(SHORT_WAIT_S)
    task_id = setup.submit("claude", prompt="[[bash:echo late > expired.txt]]")
    approval = pending_approval(setup, task_id)
    task = setup.wait_final(task_id, timeout=60)
    expired = setup.api.get(f"/api/approvals/{approval['id']}/").json()
    assert (expired["state"], expired["decided_by"]) == ("expired", "timeout")
    assert not (setup.repo / "expired.txt").exists()
    assert [r.get("is_error") for r in tool_results(fake_model_api)] == [True]  # the CLI denied it itself
    assert task["state"] == "succeeded" and task["agent_result"]["is_error"] is False, task
    assert task["approvals"] == {"asked": 1, "allowed": 0, "denied": 0} and task["attention"] == ""
    assert TaskEvent.objects.filter(task_id=task_id, reason="approval expired: Bash", actor="timeout").count() == 1
