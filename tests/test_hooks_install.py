"""SPEC I5: ``manage.py install_hooks`` merges RunStead's entries into each CLI's user
config, keeps the user's, backs up, is idempotent (byte-equal second run), uninstalls
only its own entries, and leaves a malformed config untouched."""
import json
import shlex
import stat
import subprocess
import sys
import tomllib

import pytest
from django.core.management import CommandError, call_command

from machine.hooks import approval as hook_approval
from machine.hooks import store
from machine.hooks.install import (
    CLAUDE_EVENTS, CODEX_COMMENT, CODEX_EVENTS, GEMINI_EVENTS, OPENCODE_PLUGIN, PROJECT_ROOT, InstallError, hook_argv,
    install,
)
from machine.protocol import HOOK_SCRIPT, hook_python
from tests.hooks_support import fixture, hook_env, stop_sender

pytestmark = pytest.mark.backend_independent  # neither database nor layer (pytest.ini)

SCRIPT = str(PROJECT_ROOT.joinpath(*HOOK_SCRIPT))  # what the installed command runs (not -m: I7)

USER_CLAUDE = {
    "model": "opus",
    "permissions": {"allow": ["Bash(npm test:*)"]},
    "hooks": {
        "Stop": [{"hooks": [{"type": "command", "command": "say done"}]}],
        "PreToolUse": [{"matcher": "Bash", "hooks": [{"type": "command", "command": "/usr/local/bin/guard"}]}],
    },
}


@pytest.fixture
def dirs(tmp_path):
    return tmp_path / "cli", tmp_path / "state"


def backups(folder):
    return sorted(p.name for p in folder.glob("*.bak"))


def test_i5_claude_merges_keeps_user_entries_backs_up_and_is_idempotent(dirs):
    config_dir, state_dir = dirs
    config_dir.mkdir()
    settings = config_dir / "settings.json"
    settings.write_text(json.dumps(USER_CLAUDE, indent=4))
    original = settings.read_bytes()

    report = install("claude", server="https://rs.example", token="tok-123", config_dir=config_dir,
                     state_dir=state_dir)
    data = json.loads(settings.read_text())
    assert data["model"] == "opus" and data["permissions"] == USER_CLAUDE["permissions"]
    # the user's PreToolUse group stays first; RunStead's (I7, matcher "*") follows it
    assert data["hooks"]["PreToolUse"][0] == USER_CLAUDE["hooks"]["PreToolUse"][0]
    assert data["hooks"]["PreToolUse"][1]["matcher"] == "*"
    assert f"{SCRIPT} claude" in data["hooks"]["PreToolUse"][1]["hooks"][0]["command"]
    assert data["hooks"]["Stop"][0] == USER_CLAUDE["hooks"]["Stop"][0]
    ours = data["hooks"]["Stop"][1]["hooks"][0]
    assert ours["type"] == "command" and f"{SCRIPT} claude" in ours["command"] and ours["timeout"] == 10
    assert set(data["hooks"]) == {"PreToolUse", "PostToolUse", "Stop", "SessionStart", "UserPromptSubmit",
                                  "Notification", "SessionEnd", "PermissionRequest"}
    assert data["hooks"]["Notification"][0]["matcher"] == "permission_prompt"
    assert "tok-123" not in settings.read_text()
    config = state_dir / "config.json"
    assert json.loads(config.read_text()) == {"server": "https://rs.example", "token": "tok-123"}
    assert stat.S_IMODE(config.stat().st_mode) == 0o600 and stat.S_IMODE(state_dir.stat().st_mode) == 0o700
    [backup] = backups(config_dir)
    assert (config_dir / backup).read_bytes() == original
    assert any("settings.json: updated" in line for line in report.lines())

    after_first = settings.read_bytes()
    second = install("claude", server="https://rs.example", config_dir=config_dir, state_dir=state_dir)
    assert settings.read_bytes() == after_first
    assert [c.action for c in second.changes] == ["unchanged", "unchanged"]
    assert len(backups(config_dir)) == 1

    install("claude", server="https://rs.example", config_dir=config_dir, state_dir=state_dir, uninstall=True)
    assert json.loads(settings.read_text()) == USER_CLAUDE


def test_i5_claude_on_a_missing_config_creates_it_and_uninstall_leaves_it_empty(dirs):
    config_dir, state_dir = dirs
    install("claude", server="http://s", token="t", config_dir=config_dir, state_dir=state_dir)
    assert set(json.loads((config_dir / "settings.json").read_text())["hooks"]) == {
        "SessionStart", "UserPromptSubmit", "Stop", "Notification", "SessionEnd", "PreToolUse", "PostToolUse",
        "PermissionRequest"}
    install("claude", server="http://s", config_dir=config_dir, state_dir=state_dir, uninstall=True)
    assert json.loads((config_dir / "settings.json").read_text()) == {}


def test_i5_a_moved_checkout_replaces_the_old_command_in_place(dirs, monkeypatch):
    config_dir, state_dir = dirs
    install("claude", server="http://s", token="t", config_dir=config_dir, state_dir=state_dir)
    data = json.loads((config_dir / "settings.json").read_text())
    data["hooks"]["Stop"][0]["hooks"][0]["command"] = "/old/python -m machine.hooks claude"
    (config_dir / "settings.json").write_text(json.dumps(data))
    install("claude", server="http://s", config_dir=config_dir, state_dir=state_dir)
    stop = json.loads((config_dir / "settings.json").read_text())["hooks"]["Stop"]
    assert len(stop) == 1 and "/old/python" not in stop[0]["hooks"][0]["command"]


@pytest.mark.parametrize("agent,name,content", [
    ("claude", "settings.json", '{"hooks": {"Stop": [}'),
    ("gemini", "settings.json", "[1, 2"),
    ("codex", "config.toml", 'model = "gpt\n[broken'),
    ("codex", "hooks.json", "{nope"),
])
def test_i5_malformed_config_is_left_untouched_with_a_clear_error(dirs, agent, name, content):
    config_dir, state_dir = dirs
    config_dir.mkdir()
    (config_dir / name).write_text(content)
    with pytest.raises(InstallError, match="left it untouched"):
        install(agent, server="http://s", token="t", config_dir=config_dir, state_dir=state_dir)
    assert (config_dir / name).read_text() == content
    assert backups(config_dir) == []
    assert sorted(p.name for p in config_dir.iterdir()) == [name]


def test_i5_codex_notify_and_hooks_merged_second_run_byte_equal_uninstall_restores(dirs):
    config_dir, state_dir = dirs
    config_dir.mkdir()
    user_toml = 'model = "o4-mini"\napproval_policy = "on-request"\n\n[mcp_servers.docs]\ncommand = "docs-mcp"\n'
    (config_dir / "config.toml").write_text(user_toml)
    user_hooks = {"hooks": {"Stop": [{"hooks": [{"type": "command", "command": "notify-send done"}]}]}}
    (config_dir / "hooks.json").write_text(json.dumps(user_hooks))
    install("codex", server="http://s", token="t", config_dir=config_dir, state_dir=state_dir)
    parsed = tomllib.loads((config_dir / "config.toml").read_text())
    assert parsed["model"] == "o4-mini" and parsed["mcp_servers"] == {"docs": {"command": "docs-mcp"}}
    assert parsed["notify"][-4:] == ["-S", "-P", SCRIPT, "codex"]
    hooks = json.loads((config_dir / "hooks.json").read_text())["hooks"]
    assert hooks["Stop"][0] == user_hooks["hooks"]["Stop"][0] and set(hooks) == {
        "SessionStart", "UserPromptSubmit", "Stop", "PreToolUse", "PostToolUse", "PermissionRequest"}
    assert hooks["PermissionRequest"][0]["hooks"][0]["timeout"] == 630 and hooks["Stop"][1]["hooks"][0]["timeout"] == 10
    first = ((config_dir / "config.toml").read_bytes(), (config_dir / "hooks.json").read_bytes())
    install("codex", server="http://s", config_dir=config_dir, state_dir=state_dir)
    assert ((config_dir / "config.toml").read_bytes(), (config_dir / "hooks.json").read_bytes()) == first
    install("codex", server="http://s", config_dir=config_dir, state_dir=state_dir, uninstall=True)
    assert (config_dir / "config.toml").read_text() == user_toml
    assert json.loads((config_dir / "hooks.json").read_text()) == user_hooks


def test_i5_codex_with_the_users_own_notify_is_refused_untouched(dirs):
    config_dir, state_dir = dirs
    config_dir.mkdir()
    (config_dir / "config.toml").write_text('notify = ["terminal-notifier"]\n')
    with pytest.raises(InstallError, match="already sets notify"):
        install("codex", server="http://s", token="t", config_dir=config_dir, state_dir=state_dir)
    assert (config_dir / "config.toml").read_text() == 'notify = ["terminal-notifier"]\n'


def test_i5_gemini_hooks_use_milliseconds_and_keep_user_settings(dirs):
    config_dir, state_dir = dirs
    config_dir.mkdir()
    (config_dir / "settings.json").write_text(json.dumps({"theme": "GitHub", "hooks": {"enabled": True}}))
    install("gemini", server="http://s", token="t", config_dir=config_dir, state_dir=state_dir)
    data = json.loads((config_dir / "settings.json").read_text())
    assert data["theme"] == "GitHub" and data["hooks"]["enabled"] is True
    entry = data["hooks"]["BeforeAgent"][0]["hooks"][0]
    assert entry["timeout"] == 10000 and entry["name"] == "runstead" and f"{SCRIPT} gemini" in entry["command"]
    install("gemini", server="http://s", config_dir=config_dir, state_dir=state_dir, uninstall=True)
    assert json.loads((config_dir / "settings.json").read_text()) == {"theme": "GitHub", "hooks": {"enabled": True}}


def test_i5_opencode_plugin_file_carries_the_hook_command(dirs):
    config_dir, state_dir = dirs
    install("opencode", server="http://s", token="t", config_dir=config_dir, state_dir=state_dir)
    plugin = config_dir / "plugins" / "runstead.js"
    text = plugin.read_text()
    assert f'"-P", "{SCRIPT}", "opencode"]' in text and "export const RunStead" in text
    assert f"RUNSTEAD_HOOK_DIR={state_dir}" in text
    first = plugin.read_bytes()
    install("opencode", server="http://s", config_dir=config_dir, state_dir=state_dir)
    assert plugin.read_bytes() == first
    install("opencode", server="http://s", config_dir=config_dir, state_dir=state_dir, uninstall=True)
    assert not plugin.exists()


def test_i5_install_without_any_token_is_refused(dirs):
    config_dir, state_dir = dirs
    with pytest.raises(InstallError, match="no owner token"):
        install("claude", server="http://s", config_dir=config_dir, state_dir=state_dir)
    assert not config_dir.exists()


def test_i5_management_command_prints_changes_and_fails_clearly(dirs, capsys):
    config_dir, state_dir = dirs
    call_command("install_hooks", "claude", "--server", "http://s", "--token", "t", "--config-dir", str(config_dir),
                 "--state-dir", str(state_dir))
    out = capsys.readouterr().out
    assert f"{config_dir / 'settings.json'}: created" in out and "config.json: created" in out
    (config_dir / "settings.json").write_text("{")
    with pytest.raises(CommandError, match="not valid JSON"):
        call_command("install_hooks", "claude", "--server", "http://s", "--config-dir", str(config_dir),
                     "--state-dir", str(state_dir))


def test_i5_install_refuses_a_server_that_is_not_an_http_url(tmp_path):
    with pytest.raises(CommandError, match="http"):
        call_command("install_hooks", "claude", "--server", "notaurl", "--token", "t",
                     "--config-dir", str(tmp_path / "cli"), "--state-dir", str(tmp_path / "state"))
    assert not (tmp_path / "cli").exists() and not (tmp_path / "state").exists()


# --- Q3: install_hooks and the settings --------------------------------------------------


def test_q3_install_hooks_adds_permission_request_with_a_timeout_above_the_wait(tmp_path):
    config_dir, state_dir = tmp_path / "claude", tmp_path / "state"
    install("claude", server="http://s", token="t", config_dir=config_dir, state_dir=state_dir)
    settings = config_dir / "settings.json"
    hooks = json.loads(settings.read_text())["hooks"]
    [group] = hooks["PermissionRequest"]
    assert group["matcher"] == "*" and group["hooks"][0]["timeout"] == 630  # 600 + 30
    assert {h["hooks"][0]["timeout"] for e, [h] in hooks.items() if e != "PermissionRequest"} == {10}
    assert json.loads((state_dir / "config.json").read_text()) == {"server": "http://s", "token": "t"}
    first = settings.read_bytes()
    install("claude", server="http://s", token="t", config_dir=config_dir, state_dir=state_dir)
    assert settings.read_bytes() == first  # idempotent
    install("claude", server="http://s", token="t", config_dir=config_dir, state_dir=state_dir, approval_wait_s=120)
    hooks = json.loads(settings.read_text())["hooks"]
    assert [g["hooks"][0]["timeout"] for g in hooks["PermissionRequest"]] == [150]
    assert json.loads((state_dir / "config.json").read_text())["approval_wait_s"] == 120
    again = settings.read_bytes()
    install("claude", server="http://s", config_dir=config_dir, state_dir=state_dir)  # the configured wait stays
    assert settings.read_bytes() == again
    config = store.read_config(state_dir)
    assert hook_approval.load_settings(config, {}).wait_s == 120
    assert hook_approval.load_settings(config, {"RUNSTEAD_HOOK_APPROVAL_WAIT_S": "2.5"}).wait_s == 2.5
    assert hook_approval.load_settings({}, {}) == hook_approval.Settings(wait_s=600, unreachable_s=10, poll_s=25)
    assert hook_approval.load_settings({}, {"RUNSTEAD_HOOK_APPROVAL_POLL_S": "90"}).poll_s == 25


def test_i5_i7_installed_command_skips_site_and_finds_its_bytecode_written(dirs):
    """I7: the command ``install_hooks`` writes runs the interpreter with ``-S`` (a hook
    needs only the standard library) and ``-P``, the hook's script by its path (no
    ``runpy``), and the install writes the bytecode of the modules
    a hook imports, so a hook never compiles them, not even where
    ``PYTHONDONTWRITEBYTECODE`` is set."""
    import importlib.util
    import sys
    from pathlib import Path

    import machine.hooks.mapping as mapping

    config_dir, state_dir = dirs
    cached = Path(importlib.util.cache_from_source(mapping.__file__))
    cached.unlink(missing_ok=True)  # Python recompiles it in memory meanwhile: harmless to other tests
    install("claude", server="http://127.0.0.1:8000", token="t", config_dir=config_dir, state_dir=state_dir)
    assert cached.exists()
    command = json.loads((config_dir / "settings.json").read_text())["hooks"]["Stop"][0]["hooks"][0]["command"]
    assert f"{sys.executable} -S -P {SCRIPT} claude" in command


# --- I5: entries an older install wrote (before the hooks moved to machine/) ----------------

OLD_SCRIPT = str(PROJECT_ROOT / "sessions_app" / "hooks" / "__main__.py")


def old_argv(agent: str, state_dir, form: str) -> list[str]:
    """The command an older ``install_hooks`` wrote: the script by its path (``script``)
    or, before that, the module (``module``)."""
    head = ["/usr/bin/env", f"PYTHONPATH={PROJECT_ROOT}", f"RUNSTEAD_HOOK_DIR={state_dir}", sys.executable]
    return head + (["-S", "-P", OLD_SCRIPT] if form == "script" else ["-m", "sessions_app.hooks"]) + [agent]


FOREIGN = {"type": "command", "command": "/usr/local/bin/audit", "timeout": 5}
JSON_AGENTS = {  # agent -> (file, events)
    "claude": ("settings.json", CLAUDE_EVENTS),
    "codex": ("hooks.json", CODEX_EVENTS),
    "gemini": ("settings.json", GEMINI_EVENTS),
}


def old_hooks(agent: str, state_dir, events) -> dict:
    """A hooks object as an older install left it, among the user's own: every event with
    the old entry (the script form, or the module form for every other one), the first
    event's in a group shared with a foreign entry, and the second's twice (both forms),
    beside a foreign group of the user's."""
    hooks = {}
    for n, (event, matcher) in enumerate(events.items()):
        old = {"type": "command", "command": shlex.join(old_argv(agent, state_dir, ("script", "module")[n % 2])),
               "timeout": 10}
        groups = [{"matcher": "Bash", "hooks": [dict(FOREIGN, command=f"/usr/local/bin/audit {event}")]}]
        if n == 0:
            groups.append({"hooks": [FOREIGN, old]})
        else:
            groups.append({**({"matcher": matcher} if matcher else {}), "hooks": [old]})
        if n == 1:
            groups.append({"hooks": [dict(old, command=shlex.join(old_argv(agent, state_dir, "script")))]})
        hooks[event] = groups
    return hooks


def foreign_entries(hooks: dict) -> list[tuple[str, dict]]:
    return [(event, entry) for event, groups in hooks.items() for group in groups for entry in group["hooks"]
            if entry["command"].startswith(FOREIGN["command"])]


@pytest.mark.parametrize("agent", ["claude", "codex", "gemini"])
def test_i5_install_rewrites_entries_older_installs_wrote(dirs, agent):
    """I5: a config holding the entries an older install wrote (``sessions_app/hooks/__main__.py``
    or ``-m sessions_app.hooks``, alone, twice, or in a group with a foreign entry) is
    upgraded in one run: exactly one RunStead entry per event, running the current
    command, and every foreign entry kept; a second run changes nothing."""
    config_dir, state_dir = dirs
    config_dir.mkdir()
    name, events = JSON_AGENTS[agent]
    before = {"theme": "dark", "hooks": old_hooks(agent, state_dir, events)}
    (config_dir / name).write_text(json.dumps(before, indent=2))
    if agent == "codex":
        toml = f'{CODEX_COMMENT}\nnotify = {json.dumps(old_argv(agent, state_dir, "script"))}\nmodel = "o4-mini"\n'
        (config_dir / "config.toml").write_text(toml)

    install(agent, server="http://s", token="t", config_dir=config_dir, state_dir=state_dir)

    command = shlex.join(hook_argv(agent, state_dir))
    after = json.loads((config_dir / name).read_text())
    assert after["theme"] == "dark" and set(after["hooks"]) == set(events)
    for event in events:
        ours = [e for g in after["hooks"][event] for e in g["hooks"] if "__main__.py" in e["command"]
                or "-m " in e["command"]]
        assert [e["command"] for e in ours] == [command], event
    assert foreign_entries(after["hooks"]) == foreign_entries(before["hooks"])
    assert "sessions_app" not in (config_dir / name).read_text()
    files = [config_dir / name]
    if agent == "codex":
        toml = tomllib.loads((config_dir / "config.toml").read_text())
        assert toml == {"model": "o4-mini", "notify": hook_argv(agent, state_dir)}
        assert (config_dir / "config.toml").read_text().count("notify") == 1 + CODEX_COMMENT.count("notify")
        files.append(config_dir / "config.toml")

    upgraded = [f.read_bytes() for f in files]
    report = install(agent, server="http://s", config_dir=config_dir, state_dir=state_dir)
    assert [f.read_bytes() for f in files] == upgraded
    assert {c.action for c in report.changes} == {"unchanged"}


def test_i5_install_rewrites_the_opencode_plugin_an_older_install_wrote(dirs):
    """I5: the plugin file holds RunStead's command alone: an older one (``-m
    sessions_app.hooks``) is replaced by the current one in one run, then left as it is."""
    config_dir, state_dir = dirs
    plugin = config_dir / "plugins" / "runstead.js"
    plugin.parent.mkdir(parents=True)
    template = OPENCODE_PLUGIN.read_text()
    current = 'const HOOK_COMMAND = ["python3", "-m", "machine.hooks", "opencode"]'
    plugin.write_text(template.replace(current, "const HOOK_COMMAND = " + json.dumps(
        old_argv("opencode", state_dir, "module"))))
    install("opencode", server="http://s", token="t", config_dir=config_dir, state_dir=state_dir)
    text = plugin.read_text()
    assert "sessions_app" not in text and text.count("const HOOK_COMMAND = ") == 1
    assert "const HOOK_COMMAND = " + json.dumps(hook_argv("opencode", state_dir)) in text
    upgraded = plugin.read_bytes()
    install("opencode", server="http://s", config_dir=config_dir, state_dir=state_dir)
    assert plugin.read_bytes() == upgraded


@pytest.mark.parametrize("form", ["script", "module"])
def test_i5_i1_the_command_older_installs_wrote_still_records_like_the_new_one(tmp_path, form):
    """I1, I5: until ``install_hooks`` rewrites it, an old entry still answers: the
    payload a CLI sends gives the same outbox rows through ``sessions_app/hooks/__main__.py``
    (or ``-m sessions_app.hooks``) as through ``machine/hooks/__main__.py``."""
    payload = json.dumps(fixture("claude", "user_prompt_submit", session_id="old-entry")).encode()
    recorded = {}
    for which, state_dir in (("old", tmp_path / "old"), ("new", tmp_path / "new")):
        argv = old_argv("claude", state_dir, form)[3:] if which == "old" else hook_python(
            sys.executable, str(PROJECT_ROOT)) + ["claude"]
        try:
            done = subprocess.run(argv, input=payload, capture_output=True, timeout=30, env=hook_env(state_dir),
                                  cwd="/")
            assert (done.returncode, done.stdout, done.stderr) == (0, b"", b""), which
            assert not (state_dir / store.HOOK_LOG).exists(), (state_dir / store.HOOK_LOG).read_text()
            with store.Outbox(state_dir) as outbox:
                recorded[which] = [(r.method, r.path, {k: v for k, v in (r.body or {}).items() if k != "turn_id"})
                                   for r in outbox.rows()]
        finally:
            stop_sender(state_dir)
    assert recorded["old"] == recorded["new"] and len(recorded["new"]) == 3
