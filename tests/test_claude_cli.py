"""The real Claude Code CLI runs here offline (the fixture the G and I tests build on)."""
import json
import subprocess

import pytest

from tests.claude_cli import claude_bin, claude_env, fake_model_api  # noqa: F401

pytestmark = pytest.mark.backend_independent  # neither database nor layer (pytest.ini)


def _run(args, env, cwd):
    return subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)


def test_g2_real_claude_stream_json_offline(fake_model_api, tmp_path):  # noqa: F811
    env = claude_env(home=tmp_path / "home", api=fake_model_api)
    proc = _run([claude_bin(), "-p", "say hi", "--output-format", "stream-json", "--verbose"], env, tmp_path)
    events = [json.loads(line) for line in proc.stdout.splitlines()]
    init = next(e for e in events if e["type"] == "system" and e.get("subtype") == "init")
    result = events[-1]
    assert proc.returncode == 0, proc.stderr
    assert result["type"] == "result" and result["is_error"] is False
    assert result["session_id"] == init["session_id"]
    assert result["result"] == "ok: say hi"
    assert fake_model_api.requests, "the CLI never called the fake Messages API"


def test_g3_real_claude_api_error_is_error(fake_model_api, tmp_path):  # noqa: F811
    env = claude_env(home=tmp_path / "home", api=fake_model_api)
    proc = _run([claude_bin(), "-p", "[[error400]]", "--output-format", "stream-json", "--verbose"], env, tmp_path)
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["type"] == "result"
    assert result["is_error"] is True
