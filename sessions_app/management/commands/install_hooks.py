"""``python manage.py install_hooks AGENT --server URL [--token T] [--config-dir DIR]
[--state-dir DIR] [--approval-wait-s S] [--machine ID] [--alias [--shell-rc FILE]] [--uninstall]`` (SPEC I5, Q3). The work is in ``machine.hooks.install``."""
import uuid
from pathlib import Path
from urllib.parse import urlsplit

from django.core.management.base import BaseCommand, CommandError

from machine.hooks import AGENTS
from machine.hooks.install import InstallError, install


class Command(BaseCommand):
    help = "Install RunStead's hooks into an agent CLI's user config (SPEC I5)."
    requires_system_checks = []
    requires_migrations_checks = False

    def add_arguments(self, parser):
        parser.add_argument("agent", choices=AGENTS)
        parser.add_argument("--server", help="RunStead service URL (required unless --uninstall)")
        parser.add_argument("--token", help="owner API token (kept in the hook state dir, mode 0600)")
        parser.add_argument("--config-dir", type=Path, help="the CLI's config folder (default: its usual one)")
        parser.add_argument("--state-dir", type=Path, help="hook state folder (default ~/.runstead/hooks)")
        parser.add_argument("--approval-wait-s", type=int, default=None,
                            help="how long Claude Code's PermissionRequest hook waits for your answer (Q3; "
                                 "default 600; its hook timeout is this plus 30)")
        parser.add_argument("--machine", type=uuid.UUID, default=None,
                            help="the paired machine these hooks run on (T1: its sessions can take messages)")
        parser.add_argument("--alias", action="store_true",
                            help="T3: add a shell alias so that AGENT starts under runstead-term (the terminal wrapper)")
        parser.add_argument("--shell-rc", type=Path, default=None,
                            help="the shell rc file for --alias (default by $SHELL: ~/.zshrc, ~/.bashrc, ~/.profile)")
        parser.add_argument("--uninstall", action="store_true", help="remove only RunStead's entries")

    def handle(self, *args, **options):
        if not options["uninstall"]:
            server = urlsplit(options["server"] or "")
            if server.scheme not in ("http", "https") or not server.netloc:
                raise CommandError("--server needs the service's http(s) URL, e.g. --server https://runstead.example.com")
        try:
            report = install(
                options["agent"], server=options["server"], token=options["token"],
                config_dir=options["config_dir"], state_dir=options["state_dir"], uninstall=options["uninstall"],
                approval_wait_s=options["approval_wait_s"], machine=options["machine"] and str(options["machine"]),
                alias=options["alias"], shell_rc=options["shell_rc"],
            )
        except InstallError as error:
            raise CommandError(str(error)) from None
        for line in report.lines():
            self.stdout.write(line)
