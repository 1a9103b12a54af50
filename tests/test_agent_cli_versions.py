"""The presets' tested versions (SPEC G1; issue 21): ``worker --check`` asks each real
CLI for ``--version`` and shows it beside the preset's ``tested_version``, warning when
they differ; and the pins that scripts/install_agent_clis.sh installs (the CLIs every
real-CLI test drives) are exactly those tested versions.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from machine.worker.check import cli_version
from machine.worker.presets import PRESETS
from tests.agent_clis import cli_bin

pytestmark = pytest.mark.backend_independent  # neither database nor layer (pytest.ini)

BASE_DIR = Path(__file__).resolve().parent.parent
INSTALL_SCRIPT = BASE_DIR / "scripts" / "install_agent_clis.sh"
NPM_NAMES = {"@anthropic-ai/claude-code": "claude", "@openai/codex": "codex", "@google/gemini-cli": "gemini",
             "opencode-ai": "opencode"}


def _check(tmp_path, toml: str):
    config = tmp_path / "worker.toml"
    config.write_text(toml)
    home = tmp_path / "home"  # Codex writes helper files under ~/.codex even for --version
    home.mkdir(exist_ok=True)
    env = {**os.environ, "HOME": str(home)}
    return subprocess.run([sys.executable, "manage.py", "worker", "--config", str(config), "--check"], cwd=BASE_DIR,
                          env=env, capture_output=True, text=True, timeout=120)


def _profile_block(report: str, name: str) -> str:
    return report.split(f"[profiles.{name}]", 1)[1].split("\n[profiles.", 1)[0]


def test_g1_install_script_pins_are_the_presets_tested_versions():
    script = INSTALL_SCRIPT.read_text()
    npm = dict(re.findall(r'^\s*"(@?[\w./-]+)@([\w.+-]+)"\s*$', script, re.MULTILINE))
    pins = {NPM_NAMES[name]: version for name, version in npm.items()}
    pins["aider"] = re.search(r"^AIDER_VERSION=([\w.+-]+)$", script, re.MULTILINE).group(1)
    assert pins == {name: preset.tested_version for name, preset in PRESETS.items()}


@pytest.mark.slow
def test_g1_worker_check_shows_each_real_cli_version_beside_the_tested_one(tmp_path):
    toml = f'allowed_roots = ["{tmp_path}"]\n' + "".join(
        f'[profiles.{name}]\npreset = "{name}"\nbinary = "{cli_bin(name)}"\n' for name in PRESETS)
    out = _check(tmp_path, toml)
    assert out.returncode == 0, out.stdout + out.stderr
    for name, preset in PRESETS.items():
        block = _profile_block(out.stdout, name)
        assert f"version:    {preset.tested_version}  (tested: {preset.tested_version})" in block, block
    assert "WARNING" not in out.stdout


def test_g1_worker_check_warns_when_the_cli_is_not_the_tested_version(tmp_path):
    other = tmp_path / "codex"
    other.write_text("#!/bin/sh\necho 'codex-cli 0.170.1'\n")
    broken = tmp_path / "gemini"
    broken.write_text("#!/bin/sh\necho 'unknown option --version' >&2\nexit 2\n")
    for path in (other, broken):
        path.chmod(0o755)
    toml = (f'allowed_roots = ["{tmp_path}"]\n[profiles.cx]\npreset = "codex"\nbinary = "{other}"\n'
            f'[profiles.gm]\npreset = "gemini"\nbinary = "{broken}"\n'
            '[profiles.plain]\nargv = ["/bin/echo", "{prompt}"]\n')
    out = _check(tmp_path, toml)
    # A different version warns; it does not break the profile (the CLI may well work).
    assert out.returncode == 0, out.stdout + out.stderr
    codex = _profile_block(out.stdout, "cx")
    assert "[profiles.cx]  ok" in out.stdout
    assert "version:    0.170.1  WARNING: differs from the tested 0.169.0" in codex
    gemini = _profile_block(out.stdout, "gm")
    assert "version:    unknown  WARNING: `--version` exited 2: unknown option --version" in gemini
    assert "version:" not in _profile_block(out.stdout, "plain")  # no preset, nothing to compare
    assert "WARNING: 2 profile(s) run a CLI version other than the preset's tested one: cx, gm" in out.stdout


def test_g1_cli_version_reads_the_number_out_of_each_clis_own_wording(tmp_path):
    answers = {"2.1.328 (Claude Code)": "2.1.328", "codex-cli 0.169.0": "0.169.0", "0.61.0": "0.61.0",
               "aider 0.86.2": "0.86.2", "v1.2.3-beta.1": "1.2.3-beta.1"}
    for text, version in answers.items():
        fake = tmp_path / "fake"
        fake.write_text(f"#!/bin/sh\necho '{text}'\n")
        fake.chmod(0o755)
        assert cli_version(str(fake)) == (version, "")
    hangs = tmp_path / "hangs"
    hangs.write_text("#!/bin/sh\nexec sleep 30\n")
    hangs.chmod(0o755)
    assert cli_version(str(hangs), timeout_s=0.5) == (None, "`--version` gave no answer within 0.5 s")
