"""SPEC T1, T3: ``install_hooks --alias`` adds one shell alias line so that the agent
started by its name runs under the terminal wrapper (in the user's rc file, chosen by
``$SHELL`` unless ``--shell-rc``), idempotent (a second run is byte-equal), keeping every
other line; ``--uninstall`` removes that line only. ``--machine`` records the paired
machine the hooks bind their sessions to, kept by a later install without it."""
import subprocess
import uuid

import pytest
from django.core.management import CommandError, call_command

from machine.hooks import store
from machine.hooks.entry import binding
from machine.hooks.install import ALIAS_COMMENT, WRAPPER, default_shell_rc

pytestmark = pytest.mark.backend_independent  # neither database nor layer (pytest.ini)

SERVER = "https://runstead.example.com"


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("SHELL", "/bin/bash")
    return tmp_path


def hooks(home, *args):
    call_command("install_hooks", "claude", "--server", SERVER, "--token", "t0k", "--config-dir",
                 str(home / ".claude"), "--state-dir", str(home / "state"), *args)


def test_t3_alias_in_the_shells_rc_idempotent_other_lines_kept_and_removed_by_uninstall(home):
    rc = home / ".bashrc"
    rc.write_text("export EDITOR=vi\nalias ll='ls -l'")  # no newline at the end
    hooks(home, "--alias")
    lines = rc.read_text().splitlines()
    assert lines[:2] == ["export EDITOR=vi", "alias ll='ls -l'"] and len(lines) == 3
    assert lines[2] == f"alias claude='{WRAPPER} claude'  {ALIAS_COMMENT}"
    once = rc.read_bytes()
    hooks(home, "--alias")
    assert rc.read_bytes() == once  # byte-equal second run
    # the shell runs `claude` as the wrapper
    shown = subprocess.run(["bash", "-c", f"shopt -s expand_aliases; . {rc}; alias claude"],
                           capture_output=True, text=True, env={"HOME": str(home), "PATH": "/usr/bin:/bin"})
    assert shown.stdout.strip() == f"alias claude='{WRAPPER} claude'"
    # the script it names starts the wrapper (its usage line: no agent given)
    usage = subprocess.run([str(WRAPPER)], capture_output=True, text=True)
    assert usage.returncode == 2 and "runstead-term claude" in usage.stderr
    call_command("install_hooks", "claude", "--uninstall", "--config-dir", str(home / ".claude"),
                 "--state-dir", str(home / "state"))
    assert rc.read_text() == "export EDITOR=vi\nalias ll='ls -l'\n"


def test_t3_alias_follows_the_shell_or_shell_rc_and_replaces_an_older_line_of_ours(home):
    assert default_shell_rc("/usr/bin/zsh") == home / ".zshrc"
    assert default_shell_rc("/bin/sh") == home / ".profile"
    rc = home / "my.rc"
    rc.write_text(f"alias claude='/old/checkout/scripts/runstead-term claude'  {ALIAS_COMMENT}\nset -o vi\n")
    hooks(home, "--alias", "--shell-rc", str(rc))
    assert rc.read_text() == f"alias claude='{WRAPPER} claude'  {ALIAS_COMMENT}\nset -o vi\n"
    assert not (home / ".bashrc").exists()
    hooks(home)  # without --alias: the rc file is not touched
    assert rc.read_text() == f"alias claude='{WRAPPER} claude'  {ALIAS_COMMENT}\nset -o vi\n"


def test_t3_a_users_own_claude_alias_is_left_alone(home):
    rc = home / ".bashrc"
    rc.write_text("alias claude='claude --model opus'\n")
    hooks(home)
    call_command("install_hooks", "claude", "--uninstall", "--config-dir", str(home / ".claude"),
                 "--state-dir", str(home / "state"))
    assert rc.read_text() == "alias claude='claude --model opus'\n"


def test_t1_install_hooks_machine_binds_sessions_and_is_kept_by_a_later_install(home):
    machine_id = uuid.uuid4()
    hooks(home, "--machine", str(machine_id))
    config = store.read_config(home / "state")
    assert config["machine"] == str(machine_id)
    assert binding(config, {}, "claude") == {"machine": str(machine_id), "channel": "hook"}
    assert binding(config, {"RUNSTEAD_TERMINAL": "/x"}, "codex") == {"machine": str(machine_id), "channel": "terminal"}
    assert binding(config, {}, "gemini") == {"machine": str(machine_id), "channel": "none"}
    hooks(home)  # a later install without --machine keeps it
    assert store.read_config(home / "state")["machine"] == str(machine_id)
    with pytest.raises(CommandError, match="invalid UUID"):
        call_command("install_hooks", "claude", "--server", SERVER, "--machine", "not-a-uuid")
    fresh = home / "fresh"
    call_command("install_hooks", "claude", "--server", SERVER, "--token", "t0k", "--config-dir", str(fresh / "c"),
                 "--state-dir", str(fresh / "s"))
    assert binding(store.read_config(fresh / "s"), {}, "claude") == {}  # not on a paired machine: unbound
