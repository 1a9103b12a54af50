"""Where the tests find the real agent CLIs (SPEC G1, I; ../shared/AGENTS.md).

``scripts/install_agent_clis.sh`` (run by ``.ci/run``) installs the pinned CLIs into
``var/agent-clis``: Claude Code, Codex, Gemini CLI and opencode from npm
(``node_modules/.bin/``), aider into its own virtualenv (``aider/bin/aider``), and the
package opencode installs for a plugin folder (``opencode-plugin-deps/``).

``cli_bin(name)`` is the one rule for a test that needs a CLI: the binary's absolute path
(``$RUNSTEAD_<NAME>_BIN`` or the installed one); missing, the test is skipped locally and
FAILS under ``CI=true``, where the script installed it.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

BASE_DIR = Path(__file__).resolve().parent.parent
CLI_DIR = BASE_DIR / "var" / "agent-clis"
NPM_BIN = CLI_DIR / "node_modules" / ".bin"
DEFAULT_BINS = {
    "claude": NPM_BIN / "claude",
    "codex": NPM_BIN / "codex",
    "gemini": NPM_BIN / "gemini",
    "opencode": NPM_BIN / "opencode",
    "aider": CLI_DIR / "aider" / "bin" / "aider",
}
# What opencode npm-installs into a config folder that holds a plugin (opencode-ai's
# `@opencode-ai/plugin` at its own version); copied in beforehand, no run waits for it.
OPENCODE_PLUGIN_DEPS = CLI_DIR / "opencode-plugin-deps"


def missing(what: str) -> None:
    """Skip the calling test (``what`` is missing), or fail it under ``CI=true``."""
    message = f"{what}: run scripts/install_agent_clis.sh"
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true: {message}")
    pytest.skip(message)


def cli_bin(name: str) -> str:
    """Absolute path of the installed ``name`` CLI (a key of ``DEFAULT_BINS``), or
    ``$RUNSTEAD_<NAME>_BIN``; skips (locally) or fails (CI) the calling test without it."""
    path = os.environ.get(f"RUNSTEAD_{name.upper()}_BIN") or str(DEFAULT_BINS[name])
    if os.access(path, os.X_OK):
        return path
    missing(f"{name} is not installed at {path}")


@dataclass
class Offline:
    """How to run one real CLI offline against a fake model API: ``env`` are the
    variables to set (HOME and the CLI's own; config files already written under
    ``home``), ``extra_args`` what a test profile adds to the preset's argv."""

    name: str
    env: dict
    extra_args: list[str] = field(default_factory=list)

    def profile(self, **keys) -> dict:
        """A worker profile table (as a dict) for this CLI's preset, offline."""
        return {"preset": self.name, "binary": cli_bin(self.name), "extra_args": self.extra_args,
                "env": self.env, **keys}

    def process_env(self, preset_env: dict | None = None) -> dict:
        """A whole environment for running the CLI directly (no RunStead or vendor
        secrets from this process; the preset's env, then the offline env)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(SECRET_PREFIXES)}
        return {**env, **(preset_env or {}), **self.env}


SECRET_PREFIXES = ("RUNSTEAD_", "ANTHROPIC_", "CLAUDE_", "OPENAI_", "CODEX_", "GEMINI_", "GOOGLE_", "OPENCODE_",
                   "AIDER_")


def offline(name: str, home: Path, api) -> Offline:
    """``Offline`` for CLI ``name`` with ``home`` (created) as its HOME, talking to ``api``
    (a ``tests.model_apis`` fake of its wire protocol; ../shared/AGENTS.md for each)."""
    home = Path(home)
    home.mkdir(parents=True, exist_ok=True)
    if name == "claude":
        (home / ".claude").mkdir(exist_ok=True)
        state = home / ".claude.json"
        if not state.exists():
            state.write_text(json.dumps({"hasCompletedOnboarding": True, "bypassPermissionsModeAccepted": True}))
        return Offline(name, {
            "HOME": str(home), "ANTHROPIC_BASE_URL": api.url, "ANTHROPIC_API_KEY": "sk-test-offline",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1", "DISABLE_TELEMETRY": "1",
            # Claude Code refuses to bypass permissions as root unless told it is sandboxed.
            "IS_SANDBOX": "1",
        }, ["--permission-mode", "bypassPermissions"])
    if name == "codex":
        codex_home = home / ".codex"
        codex_home.mkdir(exist_ok=True)
        config = codex_home / "config.toml"
        if not config.exists():
            config.write_text(
                'model = "gpt-test"\nmodel_provider = "fake"\n\n[model_providers.fake]\nname = "fake"\n'
                f'base_url = "{api.url}/v1"\nwire_api = "responses"\nenv_key = "FAKE_KEY"\n')
        return Offline(name, {"HOME": str(home), "CODEX_HOME": str(codex_home), "FAKE_KEY": "x"})
    if name == "gemini":
        settings = home / ".gemini" / "settings.json"
        settings.parent.mkdir(exist_ok=True)
        if not settings.exists():
            # Without selectedType a custom base URL means "gateway" auth (exit 41).
            settings.write_text(json.dumps({"security": {"auth": {"selectedType": "gemini-api-key"}},
                                            "general": {"maxAttempts": 2},
                                            "privacy": {"usageStatisticsEnabled": False}}))
        # -m skips the "auto" router's extra call.
        return Offline(name, {"HOME": str(home), "GOOGLE_GEMINI_BASE_URL": api.url, "GEMINI_API_KEY": "x"},
                       ["-m", "gemini-2.5-flash"])
    if name == "opencode":
        xdg = {key: home / sub for key, sub in (("XDG_CONFIG_HOME", ".config"), ("XDG_DATA_HOME", ".local/share"),
                                                 ("XDG_CACHE_HOME", ".cache"), ("XDG_STATE_HOME", ".local/state"))}
        for path in xdg.values():
            path.mkdir(parents=True, exist_ok=True)
        config = xdg["XDG_CONFIG_HOME"] / "opencode" / "opencode.json"
        config.parent.mkdir(exist_ok=True)
        if not config.exists():
            config.write_text(json.dumps({
                "provider": {"fake": {"npm": "@ai-sdk/openai-compatible",
                                      "options": {"baseURL": f"{api.url}/v1", "apiKey": "x"},
                                      # dollars per million tokens, so a run reports a cost
                                      "models": {"gpt-test": {"name": "gpt-test", "cost": {"input": 3, "output": 15}}}}},
                "model": "fake/gpt-test", "small_model": "fake/gpt-test", "autoupdate": False, "share": "disabled"}))
        return Offline(name, {"HOME": str(home), **{k: str(v) for k, v in xdg.items()},
                              "OPENCODE_DISABLE_MODELS_FETCH": "1", "OPENCODE_DISABLE_AUTOUPDATE": "1"})
    if name == "aider":
        meta = home / "model-metadata.json"
        if not meta.exists():
            meta.write_text(json.dumps({"openai/gpt-test": {
                "max_input_tokens": 128000, "max_output_tokens": 4096, "input_cost_per_token": 0.000003,
                "output_cost_per_token": 0.000015, "litellm_provider": "openai", "mode": "chat"}}))
        # LITELLM_LOCAL_MODEL_COST_MAP: no cost list fetched from the internet.
        return Offline(name, {"HOME": str(home), "LITELLM_LOCAL_MODEL_COST_MAP": "True"}, [
            "--no-git", "--no-show-model-warnings", "--no-show-release-notes", "--openai-api-base", f"{api.url}/v1",
            "--openai-api-key", "x", "--model", "openai/gpt-test", "--model-metadata-file", str(meta)])
    raise ValueError(f"unknown CLI {name!r}")


def seed_opencode_plugin_deps(config_dir: Path) -> None:
    """Copy (hard links) the package opencode installs into a config folder that holds a
    plugin, so a run never waits for that install (1.18.33 installs `@opencode-ai/plugin`
    there first: about 12 s with the registry, 70 s and more without). A plain copy is
    needed: opencode replaces a symlinked ``node_modules``."""
    if not (OPENCODE_PLUGIN_DEPS / "node_modules").is_dir():
        missing(f"opencode's plugin package is not installed at {OPENCODE_PLUGIN_DEPS}")
    config_dir.mkdir(parents=True, exist_ok=True)
    for name in ("package.json", "package-lock.json"):
        shutil.copy2(OPENCODE_PLUGIN_DEPS / name, config_dir / name)
    subprocess.run(["cp", "-al", str(OPENCODE_PLUGIN_DEPS / "node_modules"), str(config_dir / "node_modules")],
                   check=True)
