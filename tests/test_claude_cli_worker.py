"""The real Claude Code CLI through the worker (SPEC G1-G3, G5): ``preset = "claude"``
with the pinned CLI (scripts/install_agent_clis.sh) running offline against the fake
Messages API of tests/claude_cli.py, a real worker subprocess and a real daphne."""
import subprocess
import uuid

import pytest

from tests.claude_cli import fake_model_api, write_claude_profile  # noqa: F401  (fixture)
from tests.live import live_daphne  # noqa: F401  (fixture)
from tests.worker_harness import SHORT_TIMINGS, LiveSetup

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

@pytest.fixture
def real_claude(live_daphne, make_owner, tmp_path, fake_model_api):  # noqa: F811
    setup = LiveSetup(live_daphne(**SHORT_TIMINGS), make_owner(), tmp_path)
    subprocess.run(["git", "init", "-q", str(setup.repo)], check=True)
    write_claude_profile(setup, api=fake_model_api, home=tmp_path / "home",
                         options='extra_args = ["--permission-mode", "bypassPermissions"]\n')
    setup.start_worker()
    yield setup
    setup.close()


def test_g3_real_claude_success_with_usage_and_session_id(real_claude, fake_model_api):  # noqa: F811
    task = real_claude.wait_final(real_claude.submit("claude", prompt="[[bash:echo hello > hello.txt]]"), timeout=90)
    assert task["state"] == "succeeded", task
    assert task["agent_result"] == {"is_error": False, "subtype": "success", "summary": "done."}
    assert task["usage"]["turns"] == 2 and task["usage"]["tool_calls"] == 1
    assert task["usage"]["cost_usd"] > 0 and task["usage"]["output_tokens"] > 0
    assert uuid.UUID(task["agent_session_id"])
    assert (real_claude.repo / "hello.txt").read_text() == "hello\n"
    git = task["evidence"]["git"]
    assert git["dirty"] == ["hello.txt"] and git["commits"] == 0
    assert fake_model_api.requests  # it really talked to the (fake) API


def test_g3_real_claude_api_400_is_error_and_failed(real_claude):
    task = real_claude.wait_final(real_claude.submit("claude", prompt="[[error400]]"), timeout=90)
    assert task["state"] == "failed"
    assert task["agent_result"]["is_error"] is True
    # This CLI version exits 1 on an API error (J6 row 7); versions that exit 0 hit row 5a.
    assert task["exit_code"] == 1
    assert task["agent_result"]["subtype"] == "api_error"
