"""The real Claude Code CLI, offline, for tests (../shared/AGENTS.md "Running the real
Claude Code offline").

``scripts/install_agent_clis.sh`` (run by ``.ci/run``) installs the pinned CLI into
``var/agent-clis``. The CLI talks to ``tests.model_apis.AnthropicAPI``, a local stand-in
for the Messages API, steered by directives in the prompt (``[[bash:CMD]]``,
``[[bash_bg:CMD]]``, ``[[error400]]``, ``[[slow:S]]``; see tests/model_apis.py).

Usage::

    from tests.claude_cli import claude_bin, fake_model_api, claude_env  # noqa: F401

    def test_x(fake_model_api, tmp_path):
        env = claude_env(home=tmp_path / "home", api=fake_model_api)
        subprocess.run([claude_bin(), "-p", "say hi", "--output-format", "stream-json",
                        "--verbose"], env=env, ...)

``claude_bin()`` skips the test when the CLI is not installed, except under ``CI=true``,
where a missing CLI fails the test (CI installs it; tests.agent_clis).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.agent_clis import cli_bin
from tests.model_apis import AnthropicAPI


def claude_bin() -> str:
    """Absolute path of the installed ``claude`` binary (``tests.agent_clis.cli_bin``:
    skipped when missing, failed under ``CI=true``)."""
    return cli_bin("claude")


# The variables of ``claude_env`` a worker profile passes to the CLI it runs.
CLI_ENV_KEYS = ("HOME", "ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC",
                "DISABLE_AUTOUPDATER", "DISABLE_TELEMETRY", "IS_SANDBOX")


def write_claude_profile(setup, *, api: AnthropicAPI, home: Path, options: str = "") -> None:
    """Write the worker config of ``setup`` (``tests.worker_harness.LiveSetup``): its
    allowed root and one ``[profiles.claude]`` running the real CLI offline against
    ``api`` with ``home`` as ``$HOME`` (``claude_env``), plus the TOML lines ``options``
    (each ending in a newline), such as ``'isolation = "worktree"\n'``."""
    env = claude_env(home=home, api=api)
    profile_env = ", ".join(f"{k} = {json.dumps(env[k])}" for k in CLI_ENV_KEYS)
    setup.config.write_text(
        f'allowed_roots = ["{setup.root}"]\n'
        '[profiles.claude]\npreset = "claude"\n'
        f"binary = {json.dumps(claude_bin())}\n"
        f"{options}"
        f"env = {{ {profile_env} }}\n"
    )


def claude_env(*, home: Path, api: AnthropicAPI, extra: dict | None = None) -> dict:
    """Environment for running the real CLI offline against ``api`` with ``home`` as
    ``$HOME`` (created; its ``.claude.json`` skips the first-run screens). Returns a new
    dict based on ``os.environ`` without any RunStead or Anthropic secrets."""
    home = Path(home)
    (home / ".claude").mkdir(parents=True, exist_ok=True)
    state = home / ".claude.json"
    if not state.exists():
        state.write_text(json.dumps({"hasCompletedOnboarding": True, "bypassPermissionsModeAccepted": True}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "CLAUDE_", "RUNSTEAD_"))}
    env.update(
        HOME=str(home),
        ANTHROPIC_BASE_URL=api.url,
        ANTHROPIC_API_KEY="sk-test-offline",
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
        DISABLE_AUTOUPDATER="1",
        DISABLE_TELEMETRY="1",
        # Claude Code refuses to bypass permissions as root unless it is told it is sandboxed.
        IS_SANDBOX="1",
        **(extra or {}),
    )
    return env


# The Messages API fake lives with the other protocols' (tests/model_apis.py); this name stays.
FakeModelAPI = AnthropicAPI


@pytest.fixture
def fake_model_api():
    """A running fake Messages API (``tests.model_apis.AnthropicAPI``) for one test."""
    with AnthropicAPI() as api:
        yield api


def which_node() -> str | None:
    """The ``node`` the CLI needs (it is a Node.js program)."""
    return shutil.which("node")
