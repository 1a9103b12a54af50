"""Every preset against its real CLI (SPEC G1-G4, G6; issue 21): a real daphne, a real
worker subprocess, and the pinned CLI (scripts/install_agent_clis.sh; skipped locally
when missing, failed under CI=true: tests/agent_clis.py) running offline against the
local fake of its model API (tests/model_apis.py), configured as a user would: the
preset plus the offline settings (tests.agent_clis.offline).

Per CLI, three tasks on one worker: a shell tool call (succeeded, the file written in the
task's folder, the agent's session id, turns, tool calls, tokens, cost where the CLI
reports one; the tool call in the task's progress, kept alive by a slow reply so a
progress post is due), an API error (the fake answers 400: `failed` with
`agent_result.is_error` whatever the exit code), and a follow-up of the first that
resumes its session (the model sees the first turn; aider refuses `resume_unsupported`).
"""
import json
import subprocess
import uuid

import pytest

from tests import model_apis
from tests.agent_clis import offline
from tests.live import live_daphne  # noqa: F401  (fixture)
from tests.worker_harness import BASE_DIR, SHORT_TIMINGS, LiveSetup

pytestmark = [pytest.mark.surface, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

APIS = {"claude": model_apis.AnthropicAPI, "codex": model_apis.ResponsesAPI, "gemini": model_apis.GeminiAPI,
        "opencode": model_apis.ChatAPI, "aider": model_apis.ChatAPI}
FAKE_CLAUDE = BASE_DIR / "scripts" / "fake_claude.py"
TOOL_PROMPT = "[[bash:echo hello > hello.txt]] [[slow:2.5]]"
# Short timings, with a lease that outlives a renewal delayed by a loaded machine (a real
# CLI starting is heavy): the tests here are about the CLIs, not lease loss.
TIMINGS = {**SHORT_TIMINGS, "RUNSTEAD_LEASE_DURATION_S": "20", "RUNSTEAD_LEASE_RENEW_S": "1"}
FINAL_TIMEOUT_S = 240  # real CLIs on a loaded 2-core machine: opencode alone can take 40 s a run
# What each CLI version exits with when its model API answers 400 (G3: not the verdict).
API_ERROR_EXIT = {"claude": 1, "codex": 1, "gemini": 144, "opencode": 1, "aider": 0}


def toml_value(value) -> str:
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + " }"
    return json.dumps(value)  # strings and lists of strings are valid TOML as JSON


@pytest.fixture
def real_cli(request, live_daphne, make_owner, tmp_path):  # noqa: F811
    """``(name, setup, api)``: a paired worker whose profile ``name`` (``request.param``)
    is that preset on the real CLI, offline against a running fake of its model API; and
    a profile ``fake-claude`` (scripts/fake_claude.py, Claude Code's stream) whose tasks
    carry a session id to follow up on."""
    name = request.param
    with APIS[name]() as api:
        setup = LiveSetup(live_daphne(**TIMINGS), make_owner(), tmp_path)
        subprocess.run(["git", "init", "-q", str(setup.repo)], check=True)
        profile = offline(name, tmp_path / "home", api).profile()
        setup.config.write_text(
            f'allowed_roots = ["{setup.root}"]\n'
            f'[profiles.fake-claude]\npreset = "claude"\nbinary = "{FAKE_CLAUDE}"\n'
            f'env = {{ FAKE_CLAUDE_COMMIT = "0", FAKE_CLAUDE_PAUSE_S = "0.1", FAKE_CLAUDE_TURNS = "1" }}\n'
            f'[profiles.{name}]\n' + "".join(f"{key} = {toml_value(value)}\n" for key, value in profile.items()))
        setup.start_worker()
        try:
            yield name, setup, api
        finally:
            setup.close()


def scratch(setup):
    """A second folder beside the repository, so two tasks run at once (A8 locks folders)."""
    folder = setup.root / "scratch"
    folder.mkdir(exist_ok=True)
    return folder


def follow_up(setup, first: dict, prompt: str) -> str:
    resp = setup.api.post("/api/tasks/", json={
        "machine": setup.machine_id, "folder": str(setup.repo), "agent": first["agent"], "prompt": prompt,
        "continue_task": first["id"]}, headers={"Idempotency-Key": str(uuid.uuid4())})
    assert resp.status_code == 201, resp.text
    return resp.json()["id"]


def saw_first_turn(api, prompt: str) -> bool:
    """Whether a request carrying ``prompt`` also carried the first task's prompt: the
    CLI resumed the session rather than starting a new one."""
    bodies = [json.dumps(body) for _, body in api.requests]
    return any(prompt in body and "echo hello > hello.txt" in body for body in bodies)


@pytest.mark.parametrize("real_cli", ["claude", "codex", "gemini", "opencode"], indirect=True)
def test_g1_g6_real_cli_tool_call_api_error_and_resume(real_cli):
    name, setup, api = real_cli
    tool_id = setup.submit(name, prompt=TOOL_PROMPT)
    if name == "opencode":
        # Two first runs of opencode 1.18.33 at once on a fresh data folder: one fails with
        # "database is locked" (its SQLite store is created by both); one after the other.
        setup.wait_final(tool_id, timeout=FINAL_TIMEOUT_S)
    error_id = setup.submit(name, prompt="[[error:400]]", folder=scratch(setup))

    task = setup.wait_final(tool_id, timeout=FINAL_TIMEOUT_S)
    assert task["state"] == "succeeded", (task["state_reason"], task["output_tail"])
    assert (setup.repo / "hello.txt").read_text() == "hello\n"  # ran in the task's folder
    assert task["agent_result"]["is_error"] is False
    assert task["agent_result"]["summary"] == "done."
    usage = task["usage"]
    assert usage["tool_calls"] == 1 and usage["turns"] >= 1
    assert usage["input_tokens"] > 0 and usage["output_tokens"] > 0
    if name in ("claude", "opencode"):  # the CLIs that report a cost
        assert usage["cost_usd"] > 0
    else:
        assert usage["cost_usd"] is None
    assert task["agent_session_id"]
    # G4: the tool call showed in the progress while the reply was still streaming.
    assert task["progress"]["usage"]["tool_calls"] == 1, task["progress"]

    error = setup.wait_final(error_id, timeout=FINAL_TIMEOUT_S)
    assert error["state"] == "failed", error
    assert error["agent_result"]["is_error"] is True
    assert error["exit_code"] == API_ERROR_EXIT[name]
    assert "fake refusal" in error["agent_result"]["summary"]

    again = setup.wait_final(follow_up(setup, task, "and the docs"), timeout=FINAL_TIMEOUT_S)
    assert again["state"] == "succeeded", (again["state_reason"], again["output_tail"])
    assert again["agent_session_id"] == task["agent_session_id"]
    assert again["agent_result"]["summary"] == "ok: and the docs"
    assert saw_first_turn(api, "and the docs")


@pytest.mark.parametrize("real_cli", ["aider"], indirect=True)
def test_g3_g6_real_aider_verdict_from_its_analytics_log_and_no_resume(real_cli):
    _, setup, api = real_cli
    ok_id = setup.submit("aider", prompt="say hi")
    error_id = setup.submit("aider", prompt="[[error:400]]", folder=scratch(setup))

    task = setup.wait_final(ok_id, timeout=FINAL_TIMEOUT_S)
    assert task["state"] == "succeeded", (task["state_reason"], task["output_tail"])
    assert task["agent_result"] == {"is_error": False, "subtype": "success", "summary": "ok: say hi"}
    usage = task["usage"]
    assert usage["turns"] == 1 and usage["tool_calls"] is None  # aider has no tool calls
    assert usage["input_tokens"] > 0 and usage["output_tokens"] > 0 and usage["cost_usd"] > 0
    assert task["agent_session_id"] is None

    error = setup.wait_final(error_id, timeout=FINAL_TIMEOUT_S)
    # aider exits 0 after the API error; its analytics log has no message_send (G3, J6 5a).
    assert (error["state"], error["exit_code"]) == ("failed", 0), error
    assert error["agent_result"] == {"is_error": True, "subtype": "api_error",
                                     "summary": "litellm.BadRequestError: OpenAIException - fake refusal"}
    assert error["state_reason"] == "agent reported api_error"

    # aider gives no session id to follow up on; one that has one is refused at the start.
    with_session = setup.wait_final(setup.submit("fake-claude", prompt="first"), timeout=60)
    assert with_session["agent_session_id"]
    refused = setup.wait_final(follow_up(setup, dict(with_session, agent="aider"), "go on"), timeout=60)
    assert refused["state"] == "not_started"
    final = next(r for r in refused["receipts"] if r["kind"] == "final")
    assert final["body"]["facts"]["refused_reason"] == "resume_unsupported"
