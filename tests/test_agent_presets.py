"""Agent presets (SPEC G1, G6, W4, K4): argv per preset as each CLI documents it, profile
keys winning over the preset's, the prompt arriving byte-equal through the worker's real
spawn path (launcher, no shell), binary lookup, and ``worker --check``."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from machine.worker import process
from machine.worker.config import ConfigError, parse_config, parse_profile
from machine.worker.presets import PRESETS, ResumeUnsupported

pytestmark = pytest.mark.backend_independent  # neither database nor layer (pytest.ini)

BASE_DIR = Path(__file__).resolve().parent.parent
RECORDER = BASE_DIR / "tests" / "agents" / "record_argv.py"
NASTY = "$(touch {marker}); --help `id` \"quoted\" 'single' \\ {folder} {prompt} -- \n second line ünïcødé"


def command(spec: dict, prompt: str = "fix the test", session: str | None = None) -> list[str]:
    return parse_profile("p", spec).command(prompt=prompt, folder="/repo", agent_session_id=session)


# --- G1: argv per preset, as the real CLI takes it (tests/test_agent_presets_real.py runs them) ----

@pytest.mark.parametrize("preset,argv", [
    ("claude", ["claude", "-p", "--output-format", "stream-json", "--verbose", "--", "fix the test"]),
    ("codex", ["codex", "exec", "--json", "--skip-git-repo-check", "--sandbox", "workspace-write", "--",
               "fix the test"]),
    ("gemini", ["gemini", "--output-format", "stream-json", "--yolo", "--prompt=fix the test"]),
    ("opencode", ["opencode", "run", "--format", "json"]),  # the prompt goes on stdin
    ("aider", ["aider", "--yes", "--no-check-update", "--no-analytics", "--analytics-log={record}",
               "--message=fix the test"]),
])
def test_g1_preset_argv_as_the_real_cli_takes_it(preset, argv):
    assert command({"preset": preset}) == argv
    assert parse_profile("p", {"preset": preset}).parser == preset


def test_g1_preset_env_and_run_record():
    """Gemini trusts the folder the worker already checked (W4); aider's analytics log
    is written into the operation directory and read as its verdict (G3)."""
    assert parse_profile("p", {"preset": "gemini"}).env == {"GEMINI_CLI_TRUST_WORKSPACE": "true"}
    assert parse_profile("p", {"preset": "gemini", "env": {"GEMINI_CLI_TRUST_WORKSPACE": "false"}}).env == {
        "GEMINI_CLI_TRUST_WORKSPACE": "false"}  # the profile's keys win
    aider = parse_profile("p", {"preset": "aider"})
    assert aider.record_path("/state/ops/1") == "/state/ops/1/aider-analytics.jsonl"
    assert "--analytics-log=/state/ops/1/aider-analytics.jsonl" in aider.command(prompt="x", folder="/r",
                                                                                 op_dir="/state/ops/1")
    assert parse_profile("p", {"preset": "claude"}).record_path("/state/ops/1") is None


def test_g1_every_preset_has_a_parser_and_fixture_named_after_it():
    fixtures = {p.name.split("_")[0].split(".")[0] for p in (BASE_DIR / "tests" / "fixtures" / "agents").iterdir()}
    assert set(PRESETS) <= fixtures


def test_g1_extra_args_and_binary_override():
    argv = command({"preset": "claude", "binary": "/opt/claude/bin/claude",
                    "extra_args": ["--permission-mode", "acceptEdits", "--max-turns", "30"]})
    assert argv == ["/opt/claude/bin/claude", "-p", "--output-format", "stream-json", "--verbose",
                    "--permission-mode", "acceptEdits", "--max-turns", "30", "--", "fix the test"]
    assert command({"preset": "codex", "extra_args": ["-m", "o3"]}) == [
        "codex", "exec", "--json", "--skip-git-repo-check", "--sandbox", "workspace-write", "-m", "o3", "--",
        "fix the test"]


def test_g1_profile_argv_wins_over_the_preset_and_keeps_its_parser():
    profile = parse_profile("p", {"preset": "claude", "argv": ["{binary}", "-p", "{prompt}", "--output-format",
                                                                "stream-json", "--verbose"]})
    assert profile.command(prompt="hi {folder}", folder="/repo") == [
        "claude", "-p", "hi {folder}", "--output-format", "stream-json", "--verbose"]
    assert (profile.parser, profile.preset) == ("claude", "claude")


def test_g1_profile_argv_replaces_only_whole_elements():
    """O4: a profile's own argv never gets the prompt spliced inside an element."""
    argv = parse_profile("p", {"argv": ["/bin/sh", "-c", "echo {prompt}", "{prompt}"]}).command(
        prompt="$(id)", folder="/r")
    assert argv == ["/bin/sh", "-c", "echo {prompt}", "$(id)"]


def test_g1_env_merges_and_prompt_via_and_parser_override():
    profile = parse_profile("p", {"preset": "claude", "env": {"ANTHROPIC_MODEL": "opus"}, "prompt_via": "stdin",
                                  "parser": "text"})
    assert profile.env == {"ANTHROPIC_MODEL": "opus"}
    assert profile.parser == "text"
    assert profile.command(prompt="p", folder="/r") == ["claude", "-p", "--output-format", "stream-json", "--verbose",
                                                        "--"]


def test_g1_config_refuses_broken_profiles_with_the_key_named():
    with pytest.raises(ConfigError, match="preset must be one of"):
        parse_profile("p", {"preset": "cursor"})
    with pytest.raises(ConfigError, match="unknown key"):
        parse_profile("p", {"preset": "claude", "argz": []})
    with pytest.raises(ConfigError, match="needs argv"):
        parse_profile("p", {})
    with pytest.raises(ConfigError, match="extra_args"):
        parse_profile("p", {"preset": "claude", "extra_args": "--yolo"})
    with pytest.raises(ConfigError, match="binary"):
        parse_profile("p", {"preset": "claude", "binary": "bin/claude"})
    with pytest.raises(ConfigError, match="aider takes the prompt as an argument"):
        parse_profile("p", {"preset": "aider", "prompt_via": "stdin"})
    with pytest.raises(ConfigError, match="opencode takes the prompt on stdin"):
        parse_profile("p", {"preset": "opencode", "prompt_via": "arg"})
    with pytest.raises(ConfigError, match="parser must be one of"):
        parse_profile("p", {"argv": ["x"], "parser": "xml"})


def test_g1_plain_profiles_still_work_as_before():
    cfg = parse_config({"allowed_roots": ["/tmp"], "profiles": {"s": {"argv": ["/bin/echo", "{prompt}", "{folder}"]}}})
    profile = cfg.profiles["s"]
    assert profile.command(prompt="a b", folder="/tmp/x") == ["/bin/echo", "a b", "/tmp/x"]
    assert (profile.parser, profile.preset, profile.resume, profile.executable) == ("text", None, None, "/bin/echo")


# --- G6: resume ---------------------------------------------------------------------------

@pytest.mark.parametrize("preset,argv", [
    ("claude", ["claude", "-p", "--output-format", "stream-json", "--verbose", "--resume", "S-1", "--", "more"]),
    ("codex", ["codex", "exec", "--json", "--skip-git-repo-check", "--sandbox", "workspace-write", "resume", "S-1",
               "--", "more"]),
    ("gemini", ["gemini", "--output-format", "stream-json", "--yolo", "--resume=S-1", "--prompt=more"]),
    ("opencode", ["opencode", "run", "--format", "json", "--session", "S-1"]),
])
def test_g6_presets_that_resume_pass_the_session_id(preset, argv):
    assert command({"preset": preset}, prompt="more", session="S-1") == argv


@pytest.mark.parametrize("spec", [{"preset": "aider"}, {"argv": ["/bin/echo", "{prompt}"]}])
def test_g6_profiles_that_cannot_resume_refuse(spec):
    with pytest.raises(ResumeUnsupported):
        command(spec, session="S-1")


# --- W4 / K4: the prompt arrives byte-equal, never through a shell ----------------------------

def _spawn(tmp_path, profile, prompt):
    record = tmp_path / "record.json"
    op_dir = tmp_path / "op"
    op_dir.mkdir()
    argv = profile.command(prompt=prompt, folder=str(tmp_path))
    env = {**os.environ, "RECORD_ARGV": str(record)}
    proc, _ = process.spawn(argv=argv, cwd=str(tmp_path), env=env, op_dir=str(op_dir),
                            stdin_text=prompt if profile.prompt_via == "stdin" else None)
    assert proc.wait(timeout=30) == 0, (op_dir / "output.log").read_text()
    return json.loads(record.read_text())


@pytest.mark.parametrize("preset", sorted(p for p in PRESETS if PRESETS[p].prompt_via == "arg"))
def test_w4_prompt_arrives_byte_equal_as_one_argument(tmp_path, preset):
    marker = tmp_path / "x"
    prompt = NASTY.replace("{marker}", str(marker))
    profile = parse_profile("p", {"preset": preset, "binary": str(RECORDER)})
    got = _spawn(tmp_path, profile, prompt)
    expected = profile.command(prompt=prompt, folder=str(tmp_path))[1:]
    assert got["argv"] == expected
    carried = [a for a in got["argv"] if prompt in a]
    (element,) = [e for e in PRESETS[preset].argv if "{prompt}" in e]
    assert carried == [element.replace("{prompt}", prompt)]
    assert got["stdin"] == ""
    assert not marker.exists()  # no shell ever ran $(touch ...)


@pytest.mark.parametrize("preset", ["claude", "codex", "gemini", "opencode"])
def test_w4_prompt_on_stdin_arrives_byte_equal(tmp_path, preset):
    marker = tmp_path / "x"
    prompt = NASTY.replace("{marker}", str(marker))
    profile = parse_profile("p", {"preset": preset, "binary": str(RECORDER), "prompt_via": "stdin"})
    got = _spawn(tmp_path, profile, prompt)
    assert got["stdin"] == prompt
    assert not any(prompt in a for a in got["argv"])
    assert not marker.exists()


# --- G1: binary lookup and worker --check --------------------------------------------------------

def test_g1_binary_is_looked_up_on_path_or_taken_absolute(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "claude").symlink_to(RECORDER)
    profile = parse_profile("p", {"preset": "claude"})
    assert profile.find_binary(str(bindir)) == str(bindir / "claude")
    assert profile.find_binary(str(tmp_path / "empty")) is None
    assert parse_profile("p", {"preset": "codex", "binary": str(RECORDER)}).find_binary("") == str(RECORDER)
    assert parse_profile("p", {"preset": "codex", "binary": str(tmp_path / "nope")}).find_binary(None) is None


def _check(tmp_path, toml: str, path: str):
    config = tmp_path / "worker.toml"
    config.write_text(toml)
    env = {**os.environ, "PATH": path}
    return subprocess.run([sys.executable, "manage.py", "worker", "--config", str(config), "--check"], cwd=BASE_DIR,
                          env=env, capture_output=True, text=True, timeout=60)


def test_g1_worker_check_prints_resolved_profiles_and_fails_on_a_missing_binary(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "claude").symlink_to(RECORDER)
    path = f"{bindir}:{Path(sys.executable).parent}:/usr/bin:/bin"
    toml = (f'allowed_roots = ["{tmp_path}"]\n'
            '[profiles.claude]\npreset = "claude"\nextra_args = ["--permission-mode", "acceptEdits"]\n')
    ok = _check(tmp_path, toml, path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "[profiles.claude]  ok" in ok.stdout
    assert f"found at {bindir / 'claude'}" in ok.stdout
    assert '"--permission-mode", "acceptEdits", "--", "{prompt}"' in ok.stdout
    assert "parser:     claude" in ok.stdout and '"--resume", "{session_id}"' in ok.stdout

    broken = _check(tmp_path, toml + '[profiles.gem]\npreset = "gemini"\n', path)
    assert broken.returncode == 1
    assert "[profiles.gem]  BROKEN" in broken.stdout and "gemini (NOT FOUND)" in broken.stdout
    assert "[profiles.claude]  ok" in broken.stdout


def test_g1_worker_check_fails_on_an_invalid_config(tmp_path):
    bad = _check(tmp_path, '[profiles.x]\npreset = "cursor"\n', os.environ["PATH"])
    assert bad.returncode == 1
    assert "BROKEN" in bad.stdout and "preset must be one of" in bad.stdout


def test_g1_check_needs_no_pairing_and_is_quick(tmp_path):
    start = time.monotonic()
    out = _check(tmp_path, '[profiles.e]\nargv = ["/bin/echo", "{prompt}"]\n', os.environ["PATH"])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "no allowed_roots" in out.stdout
    assert time.monotonic() - start < 30


# --- Q5: approvals = "ask" -----------------------------------------------------------------


def test_q5_profile_approvals_is_validated_and_off_by_default():
    assert parse_profile("p", {"preset": "claude"}).approvals == "off"
    assert parse_profile("p", {"preset": "claude", "approvals": "ask"}).approvals == "ask"
    with pytest.raises(ConfigError, match='approvals must be "off" or "ask"'):
        parse_profile("p", {"preset": "claude", "approvals": "yes"})
    with pytest.raises(ConfigError, match=r'approvals = "ask" needs a preset .*\(claude\)'):
        parse_profile("p", {"preset": "codex", "approvals": "ask"})
    with pytest.raises(ConfigError, match='approvals = "ask" needs a preset'):
        parse_profile("p", {"argv": ["/bin/echo", "{prompt}"], "approvals": "ask"})
    with pytest.raises(ConfigError, match=r'needs the element "\{binary\}"'):
        parse_profile("p", {"preset": "claude", "argv": ["/usr/bin/claude", "-p", "{prompt}"], "approvals": "ask"})


def test_q5_opencode_asks_in_its_live_conversation_only_through_the_environment():
    """opencode takes no per-run hook: its bridge answers ``permission.asked`` (the task's
    credential in the environment), so ``approvals = "ask"`` asks in a live conversation
    and adds nothing to the argv; a headless ``opencode run`` rejects by itself, so it
    does not ask (no credential is requested); a profile's own argv has no bridge."""
    profile = parse_profile("p", {"preset": "opencode", "approvals": "ask"})
    assert profile.asks_owner(live=True) and not profile.asks_owner(live=False)
    assert not profile.asks_through_settings()
    assert not parse_profile("p", {"preset": "opencode"}).asks_owner(live=True)
    claude = parse_profile("p", {"preset": "claude", "approvals": "ask"})
    assert claude.asks_owner(live=True) and claude.asks_owner(live=False) and claude.asks_through_settings()
    with pytest.raises(ConfigError, match="asks only in opencode's live conversation"):
        parse_profile("p", {"preset": "opencode", "approvals": "ask", "argv": ["{binary}", "run"]})


def test_q5_the_run_settings_go_right_after_the_executable_and_hold_no_secret():
    from machine.worker import approvals

    profile = parse_profile("p", {"preset": "claude", "approvals": "ask", "extra_args": ["--permission-mode", "default"]})
    argv = profile.command(prompt="fix it", folder="/repo", binary="/opt/claude",
                           after_binary=approvals.settings_args(wait_s=1.5))
    assert argv[:2] == ["/opt/claude", "--settings"]
    assert argv[3:] == ["-p", "--output-format", "stream-json", "--verbose", "--permission-mode", "default", "--",
                        "fix it"]
    settings = json.loads(argv[2])
    assert list(settings) == ["hooks"] and list(settings["hooks"]) == ["PermissionRequest"]
    (entry,) = settings["hooks"]["PermissionRequest"]
    (hook,) = entry["hooks"]
    assert entry["matcher"] == "*" and hook["type"] == "command"
    assert hook["timeout"] == 2 + approvals.HOOK_TIMEOUT_MARGIN_S  # above approval_wait_s (Q3)
    script = os.path.join(approvals.PROJECT_ROOT, "machine", "hooks", "__main__.py")
    assert hook["command"].endswith(f"{sys.executable} -S -P {script} claude --task")  # I7: no site, no runpy
    assert "RUNSTEAD_TASK_CREDENTIAL" not in argv[2]  # the credential goes in the environment only
    # A profile's own argv: after its {binary} element.
    own = parse_profile("p", {"preset": "claude", "approvals": "ask", "argv": ["/usr/bin/env", "{binary}", "-p", "{prompt}"]})
    assert own.command(prompt="x", folder="/r", binary="/opt/claude", after_binary=("--settings", "{}")) == [
        "/usr/bin/env", "/opt/claude", "--settings", "{}", "-p", "x"]


def test_q5_worker_check_shows_approvals(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "claude").symlink_to(RECORDER)
    path = f"{bindir}:{Path(sys.executable).parent}:/usr/bin:/bin"
    toml = (f'allowed_roots = ["{tmp_path}"]\n[profiles.asks]\npreset = "claude"\napprovals = "ask"\n'
            '[profiles.plain]\npreset = "claude"\n')
    out = _check(tmp_path, toml, path)
    assert out.returncode == 0, out.stdout + out.stderr
    asks, plain = out.stdout.split("[profiles.plain]")
    assert "approvals:  ask (the owner answers" in asks and "approvals:  off" in plain
    bad = _check(tmp_path, toml + '[profiles.c]\npreset = "codex"\napprovals = "ask"\n', path)
    assert bad.returncode == 1 and 'approvals = "ask" needs a preset' in bad.stdout
