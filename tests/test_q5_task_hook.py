"""Q5, Q3: the ``PermissionRequest`` hook inside a RunStead task (``machine/hooks/
task_approval.py``), without a CLI: its key, its outputs, and how it gives up."""
import json
import time

import pytest

from machine.hooks import task_approval
from tests.hooks_support import hook_env, run_hook

pytestmark = pytest.mark.backend_independent  # neither database nor layer (pytest.ini)

PAYLOAD = {"session_id": "7cf59fc6-37df-4860-b1e8-dfd10c2e49c5", "prompt_id": "67e6675b", "cwd": "/work/repo",
           "hook_event_name": "PermissionRequest", "tool_name": "Bash",
           "tool_input": {"command": "make deploy", "description": "deploy"},
           "permission_suggestions": [{"type": "addDirectories", "directories": ["/work"], "destination": "session"}]}


def test_q5_in_a_task_only_the_runs_entry_asks_and_only_with_a_credential(tmp_path):
    """``--task`` without a credential (approvals = "off"), or an entry of the owner's own
    configuration (no ``--task``) even with one: nothing printed at once, so the CLI decides
    (headless: denied); the owner's interactive setup (its state directory) is not asked,
    nothing is queued. Only the run's own entry asks (with the server unreachable here, it
    gives up silently once the window is over: ``RUNSTEAD_HOOK_UNREACHABLE_S``)."""
    state = tmp_path / "hooks"
    off = hook_env(state, RUNSTEAD_TASK_ID="6a0c1f0e-task")
    asking = task_env(tmp_path, RUNSTEAD_HOOK_UNREACHABLE_S="0.3")
    for argv, env in ((["--task"], off), ([], off), ([], asking)):
        started = time.monotonic()
        done = run_hook("claude", PAYLOAD, state, env=env, argv=argv)
        assert (done.returncode, done.stdout, done.stderr) == (0, b"", b"")
        assert time.monotonic() - started < 10
    assert not state.exists() or not (state / "outbox.sqlite3").exists()
    assert not (tmp_path / "asks" / "hook.log").exists()  # nothing asked yet
    done = run_hook("claude", PAYLOAD, state, env=asking, argv=["--task"])
    assert (done.returncode, done.stdout) == (0, b"")
    assert "retrying for 0.3 s" in (tmp_path / "asks" / "hook.log").read_text()  # it did try to ask


def task_env(tmp_path, **extra):
    return hook_env(tmp_path / "hooks", RUNSTEAD_TASK_ID="6a0c1f0e-task", RUNSTEAD_TASK_CREDENTIAL="c" * 43,
                    RUNSTEAD_TASK_SERVER="http://127.0.0.1:9", RUNSTEAD_TASK_HOOK_DIR=tmp_path / "asks", **extra)


def test_q5_in_a_task_a_service_that_never_answers_means_no_output_within_the_window(tmp_path):
    now = [0.0]

    def sleep(s):
        now[0] += s

    assert task_approval.ask(PAYLOAD, task_env(tmp_path), clock=lambda: now[0], sleep=sleep) is None
    assert 10 <= now[0] < 11  # Q3: unreachable for 10 s, then the CLI decides


def test_q5_in_a_task_it_asks_with_the_task_credential_and_prints_the_decision(tmp_path):
    sent = []

    def answering(state, **extra):
        def send(method, path, body, timeout_s):
            sent.append((method, path, body))
            if method == "POST":
                return {"id": "a1", "state": "pending"}
            return {"id": "a1", "state": state, **extra}
        return send

    env = task_env(tmp_path)
    allowed = task_approval.ask(PAYLOAD, env, send=answering("allowed", scope="once"))
    assert json.loads(allowed) == {"hookSpecificOutput": {"hookEventName": "PermissionRequest",
                                                          "decision": {"behavior": "allow"}}}
    (method, path, body), (_, wait_path, _) = sent
    assert (method, path, wait_path) == ("POST", "/api/approvals/", "/api/approvals/a1/?wait=25")
    assert body["task"] == "6a0c1f0e-task" and "session" not in body
    assert (body["agent"], body["tool_name"], body["tool_input"], body["cwd"]) == ("claude", "Bash", PAYLOAD["tool_input"],
                                                                                  "/work/repo")
    assert body["key"].startswith("task:claude:7cf59fc6-37df-4860-b1e8-dfd10c2e49c5:67e6675b:")
    assert body["key"].endswith(":1")
    denied = task_approval.ask(PAYLOAD, env, send=answering("denied", message="use staging"))
    assert json.loads(denied)["hookSpecificOutput"]["decision"] == {"behavior": "deny", "message": "use staging"}
    assert sent[2][2]["key"].endswith(":2")  # the same request again in the turn asks again (Q1)
    for state in ("expired", "withdrawn"):
        assert task_approval.ask(PAYLOAD, env, send=answering(state)) is None


def test_q5_in_a_task_a_refusal_means_no_output(tmp_path):
    from machine.hooks import approval

    def refused(method, path, body, timeout_s):
        raise approval.Refused("POST /api/approvals/: HTTP 401")

    assert task_approval.ask(PAYLOAD, task_env(tmp_path), send=refused) is None
    assert "HTTP 401" in (tmp_path / "asks" / "hook.log").read_text()


def test_q1_q5_the_key_counts_a_turns_identical_requests(tmp_path):
    """A request asked again in the turn (after its answer) is a new approval: its count rises."""
    env = task_env(tmp_path)
    keys = []

    def send(method, path, body, timeout_s):
        if method == "POST":
            keys.append(body["key"])
        return {"id": "a1", "state": "denied"}

    other = {**PAYLOAD, "tool_input": {"command": "ls"}}
    for payload in (PAYLOAD, PAYLOAD, other, {**PAYLOAD, "prompt_id": "next-turn"}):
        task_approval.ask(payload, env, send=send)
    assert [k.rsplit(":", 1)[1] for k in keys] == ["1", "2", "1", "1"] and keys[0][:-2] == keys[1][:-2]
    long = task_approval.request_key({**PAYLOAD, "session_id": "s" * 100, "prompt_id": "p" * 100}, hook_dir=str(tmp_path))
    assert long.startswith("task:") and len(long) <= 255
    assert all(len(k) <= 255 and k.isascii() and " " not in k for k in keys)
