"""D4: the worker as a login service. The LaunchAgent is macOS-only: its plist is built
and read back with plistlib here on Linux (launchctl itself cannot run here, so the test
checks the file, not launchd). The systemd user unit is installed and removed by the real
command, with ``systemctl`` absent from PATH (no user session manager in CI)."""
import os
import plistlib
import subprocess
import sys
from pathlib import Path

import pytest

from machine.worker import login_service

pytestmark = pytest.mark.backend_independent  # neither database nor layer (pytest.ini)

BASE_DIR = Path(__file__).resolve().parent.parent


def test_d4_launch_agent_plist_restarts_the_worker_and_logs_under_library_logs(tmp_path):
    path = login_service.install([sys.executable, "manage.py", "worker", "--state-dir", "/Users/a/.runstead"],
                           workdir="/opt/runstead", out=lambda _m: None, platform="darwin", home=tmp_path)
    assert path == tmp_path / "Library" / "LaunchAgents" / "dev.runstead.worker.plist"
    plist = plistlib.loads(path.read_bytes())
    assert plist["Label"] == "dev.runstead.worker"
    assert plist["ProgramArguments"] == [sys.executable, "manage.py", "worker", "--state-dir", "/Users/a/.runstead"]
    assert plist["RunAtLoad"] is True
    assert plist["KeepAlive"] == {"SuccessfulExit": False}
    assert plist["StandardOutPath"] == str(tmp_path / "Library" / "Logs" / "RunStead" / "worker.log")
    assert plist["StandardErrorPath"] == plist["StandardOutPath"]
    assert (tmp_path / "Library" / "Logs" / "RunStead").is_dir()
    assert plist["EnvironmentVariables"]["PATH"] == os.environ["PATH"]
    assert plist["WorkingDirectory"] == "/opt/runstead"
    login_service.uninstall(out=lambda _m: None, platform="darwin", home=tmp_path)
    assert not path.exists()


def test_d4_install_service_command_writes_a_systemd_user_unit_and_uninstall_removes_it(tmp_path):
    env = {**os.environ, "HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "cfg"), "PATH": "/nonexistent"}
    state = tmp_path / "state"
    run = lambda *extra: subprocess.run(  # noqa: E731
        [sys.executable, "manage.py", "worker", "--server", "https://runstead.example", "--state-dir", str(state), *extra],
        cwd=BASE_DIR, env=env, capture_output=True, text=True, timeout=60)
    installed = run("--install-service")
    assert installed.returncode == 0, installed.stderr
    unit = tmp_path / "cfg" / "systemd" / "user" / "runstead-worker.service"
    text = unit.read_text()
    assert f"ExecStart={sys.executable} {BASE_DIR / 'manage.py'} worker --state-dir {state} --server https://runstead.example\n" in text
    assert "Restart=on-failure\n" in text
    assert "RestartPreventExitStatus=2 3\n" in text
    assert "WantedBy=default.target\n" in text
    assert "systemctl not found; run yourself: systemctl --user enable --now runstead-worker.service" in installed.stdout
    removed = run("--uninstall-service")
    assert removed.returncode == 0, removed.stderr
    assert not unit.exists()
