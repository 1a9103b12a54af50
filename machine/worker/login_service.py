"""The worker as a login service (D4): a LaunchAgent on macOS, a systemd user unit on Linux.

``manage.py worker ... --install-service`` writes the service file for the same command
line (without ``--install-service``) and starts it; ``--uninstall-service`` stops and
removes it. The service restarts the worker when it crashes, not when it stops cleanly
(exit 0 after SIGTERM, W6) or cannot run (exit 2: state directory in use, exit 3: token
revoked; systemd only, launchd has no such list). Logs: ``~/Library/Logs/RunStead/`` on
macOS, the user journal on Linux (``journalctl --user -u runstead-worker``).

No Django here: the worker could ship alone.
"""
from __future__ import annotations

import os
import plistlib
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

LABEL = "dev.runstead.worker"
UNIT = "runstead-worker.service"
RESTART_DELAY_S = 10


def launch_agent_plist(argv: list[str], *, home: Path, workdir: str, path_env: str) -> bytes:
    """The LaunchAgent property list (XML bytes) that runs ``argv`` at login, restarts it
    after a crash (``KeepAlive``/``SuccessfulExit`` false) at most every RESTART_DELAY_S
    seconds, and logs to ``~/Library/Logs/RunStead/worker.log``."""
    logs = home / "Library" / "Logs" / "RunStead"
    return plistlib.dumps({
        "Label": LABEL,
        "ProgramArguments": list(argv),
        "WorkingDirectory": workdir,
        "RunAtLoad": True,
        "KeepAlive": {"SuccessfulExit": False},
        "ThrottleInterval": RESTART_DELAY_S,
        # launchd starts agents with a minimal PATH; agent CLIs need the owner's.
        "EnvironmentVariables": {"PATH": path_env, "PYTHONUNBUFFERED": "1"},
        "StandardOutPath": str(logs / "worker.log"),
        "StandardErrorPath": str(logs / "worker.log"),
        "ProcessType": "Interactive",
    })


def systemd_unit(argv: list[str], *, workdir: str, path_env: str) -> str:
    """A systemd user unit (text) that runs ``argv`` after login and restarts it on failure."""
    return "\n".join([
        "[Unit]",
        "Description=RunStead worker",
        "After=network-online.target",
        "",
        "[Service]",
        f"ExecStart={shlex.join(argv)}",
        f"WorkingDirectory={workdir}",
        f"Environment={shlex.quote('PATH=' + path_env)}",
        "Environment=PYTHONUNBUFFERED=1",
        "Restart=on-failure",
        f"RestartSec={RESTART_DELAY_S}",
        "RestartPreventExitStatus=2 3",
        "KillSignal=SIGTERM",
        "TimeoutStopSec=infinity",  # W6: running agents finish and report first
        "",
        "[Install]",
        "WantedBy=default.target",
        "",
    ])


def service_path(platform: str, home: Path) -> Path:
    """Where the service file goes."""
    if platform == "darwin":
        return home / "Library" / "LaunchAgents" / f"{LABEL}.plist"
    config_home = Path(os.environ.get("XDG_CONFIG_HOME") or home / ".config")
    return config_home / "systemd" / "user" / UNIT


def _run(argv: list[str], out) -> None:
    if shutil.which(argv[0]) is None:
        out(f"{argv[0]} not found; run yourself: {shlex.join(argv)}")
        return
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode != 0:
        out(f"{shlex.join(argv)} exited {result.returncode}: {result.stderr.strip()}")


def install(argv: list[str], *, workdir: str, out=print, platform: str = sys.platform, home: Path | None = None) -> Path:
    """Write the service file for ``argv`` and load it; returns the file's path."""
    home = home or Path.home()
    path = service_path(platform, home)
    path.parent.mkdir(parents=True, exist_ok=True)
    path_env = os.environ.get("PATH", "/usr/bin:/bin")
    if platform == "darwin":
        (home / "Library" / "Logs" / "RunStead").mkdir(parents=True, exist_ok=True)
        path.write_bytes(launch_agent_plist(argv, home=home, workdir=workdir, path_env=path_env))
        domain = f"gui/{os.getuid()}"
        _run(["launchctl", "bootout", domain, str(path)], lambda _msg: None)  # a previous version, if any
        _run(["launchctl", "bootstrap", domain, str(path)], out)
    else:
        path.write_text(systemd_unit(argv, workdir=workdir, path_env=path_env))
        _run(["systemctl", "--user", "daemon-reload"], out)
        _run(["systemctl", "--user", "enable", "--now", UNIT], out)
    out(f"installed {path}")
    return path


def uninstall(*, out=print, platform: str = sys.platform, home: Path | None = None) -> Path:
    """Stop the service and remove its file; returns the path it had."""
    home = home or Path.home()
    path = service_path(platform, home)
    if platform == "darwin":
        _run(["launchctl", "bootout", f"gui/{os.getuid()}", str(path)], out)
    else:
        _run(["systemctl", "--user", "disable", "--now", UNIT], out)
    if path.exists():
        path.unlink()
        out(f"removed {path}")
    else:
        out(f"no service file at {path}")
    if platform != "darwin":
        _run(["systemctl", "--user", "daemon-reload"], out)
    return path
