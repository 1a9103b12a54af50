"""README's example worker config against the real CLIs (SPEC G1; issue 21): every
profile of the README's ``[profiles.*]`` example parses, and the ones whose extra flags
can run offline run with the real CLI at its tested version against the local fake of
its model API, to a verdict of success; the flag pairs the README warns about are
refused by those same versions. A README example that a new user copies must work.
"""
import re
import subprocess
import tomllib
from concurrent.futures import ThreadPoolExecutor

import pytest

from machine.worker.config import parse_config
from machine.worker.parsers import make_parser
from tests import model_apis
from tests.agent_clis import cli_bin, offline
from tests.worker_harness import BASE_DIR

pytestmark = [pytest.mark.slow, pytest.mark.backend_independent]  # neither database nor layer (pytest.ini)

APIS = {"claude": model_apis.AnthropicAPI, "codex": model_apis.ResponsesAPI, "gemini": model_apis.GeminiAPI}
TIMEOUT_S = 120  # a real CLI starting on a loaded 2-core machine


def readme_config() -> dict:
    """The TOML block of README's presets section (the one with ``[profiles.claude]``)."""
    readme = (BASE_DIR / "README.md").read_text()
    blocks = re.findall(r"```toml\n(.*?)```", readme, re.S)
    [block] = [b for b in blocks if "[profiles.claude]" in b and "[profiles.aider]" in b]
    return tomllib.loads(block)


def run_cli(name: str, tmp_path, argv_tail: list[str] | None = None, profile_keys: dict | None = None):
    """Run CLI ``name`` offline once, from the README profile (``profile_keys`` over it) or
    with ``argv_tail`` after the binary; returns ``(completed process, parser)``."""
    home = tmp_path / name
    work = home / "work"
    work.mkdir(parents=True)
    with APIS[name]() as api:
        off = offline(name, home, api)
        config = parse_config({"profiles": {name: {**readme_config()["profiles"][name], **(profile_keys or {}),
                                                   "binary": cli_bin(name)}}})
        profile = config.profiles[name]
        argv = profile.command(prompt="say hi", folder=str(work)) if argv_tail is None else [cli_bin(name), *argv_tail]
        done = subprocess.run(argv, cwd=work, env=off.process_env(profile.env), stdin=subprocess.DEVNULL,
                              capture_output=True, timeout=TIMEOUT_S)
    parser = make_parser(profile.parser)
    parser.feed(done.stdout)
    return done, parser


def test_g1_readme_example_config_parses_with_every_preset():
    config = parse_config(readme_config())
    assert sorted(config.profiles) == ["aider", "claude", "codex", "gemini", "opencode"]
    assert all(profile.preset == name for name, profile in config.profiles.items())


def test_g1_readme_profiles_run_with_the_real_clis(tmp_path):
    with ThreadPoolExecutor(3) as pool:
        runs = dict(zip(APIS, pool.map(lambda name: run_cli(name, tmp_path), APIS)))
    for name, (done, parser) in runs.items():
        assert done.returncode == 0, (name, done.stderr[-2000:])
        assert parser.facts()["agent_result"]["is_error"] is False, (name, done.stdout[-2000:])


def test_g1_readme_warnings_hold_for_the_tested_versions(tmp_path):
    """The pairs README tells users not to add, refused by the tested versions."""
    gemini = ["--output-format", "stream-json", "--yolo", "--approval-mode", "auto_edit", "--prompt=say hi"]
    codex = ["exec", "--json", "--skip-git-repo-check", "--sandbox", "workspace-write", "--full-auto", "--", "say hi"]
    with ThreadPoolExecutor(2) as pool:
        (g, _), (c, _) = pool.map(lambda args: run_cli(args[0], tmp_path, args[1]), [("gemini", gemini), ("codex", codex)])
    assert g.returncode == 1 and b"Cannot use both --yolo (-y) and --approval-mode together" in g.stderr
    assert c.returncode == 2 and b"unexpected argument '--full-auto'" in c.stderr
