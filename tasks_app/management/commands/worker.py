"""``python manage.py worker --server URL [--state-dir DIR] [--config FILE] [--once]`` (SPEC O4).

``--install-service`` / ``--uninstall-service`` (D4) install or remove this command line
as a login service (``machine.worker.login_service``).

``--prune-worktrees`` (G7) removes what is left of the worktrees of final, integrated
worktree tasks (and their branch after a merge or a discard), prints it and exits.

``--check`` (G1) prints every profile as resolved (argv template, parser, binary found
on PATH or not, resume support, and the CLI's ``--version`` beside the preset's tested
version, with a WARNING when they differ) and exits 1 when one is broken; it needs no pairing.

A thin wrapper: everything lives in ``machine.worker`` (no Django ORM there).
Environment for tests and tuning: ``RUNSTEAD_WORKER_POLL_S`` (long-poll wait, at most and by
default ``LONG_POLL_MAX_S``, 25), ``RUNSTEAD_WORKER_PULL_IDLE_S`` (a pull with no byte for this long
is given up, D1; default ``PULL_IDLE_TIMEOUT_S``, 7), ``RUNSTEAD_WORKER_BACKOFF_BASE_S`` (R4 backoff base: the first retry waits
0.5-1 times it, default 1; the cap is 60 s), ``RUNSTEAD_WORKER_FAULT`` (crash tests only, see ``machine.worker.faults``).
Exit codes: 0 done, 1 bad usage/config, 2 state directory in use (W5), 3 token revoked.
"""
import os
import sys

from django.core.management.base import BaseCommand, CommandError

from machine.protocol import LONG_POLL_MAX_S
from machine.settings import SettingError, env_float


class Command(BaseCommand):
    help = "Run the RunStead worker loop: pull tasks, run agents under a lease, report receipts."
    requires_system_checks = []
    requires_migrations_checks = False

    def add_arguments(self, parser):
        parser.add_argument("--server", default=None, help="service base URL (default: the one used when pairing)")
        parser.add_argument("--state-dir", default="~/.runstead", help="token + local database (default ~/.runstead)")
        parser.add_argument("--config", default=None, help="TOML config (default: STATE_DIR/config.toml if present)")
        parser.add_argument("--once", action="store_true", help="pull once, run what came, report, exit")
        parser.add_argument("--check", action="store_true",
                            help="print the resolved profiles and exit (non-zero if one is broken)")
        parser.add_argument("--prune-worktrees", action="store_true",
                            help="remove the worktrees (and merged or discarded branches) of final, integrated "
                                 "worktree tasks, print what was removed, and exit (G7)")
        service = parser.add_mutually_exclusive_group()
        service.add_argument("--install-service", action="store_true",
                             help="install this command line as a login service (LaunchAgent / systemd user unit, D4)")
        service.add_argument("--uninstall-service", action="store_true", help="stop and remove the login service (D4)")

    def handle(self, *args, **options):
        if options["install_service"] or options["uninstall_service"]:
            return self._service(options)
        from machine.worker.config import ConfigError, load_config
        from machine.worker.loop import WorkerOptions, open_worker
        from machine.worker.store import StateDirLocked

        state_dir = os.path.abspath(os.path.expanduser(options["state_dir"]))
        if options["prune_worktrees"]:
            return self._prune(state_dir)
        config_path = options["config"]
        if config_path is None and os.path.exists(os.path.join(state_dir, "config.toml")):
            config_path = os.path.join(state_dir, "config.toml")
        try:
            config = load_config(config_path)
        except ConfigError as exc:
            if options["check"]:
                self.stdout.write(f"config {config_path}: BROKEN: {exc}\n")
                sys.exit(1)
            raise CommandError(str(exc))
        if options["check"]:
            from machine.worker.check import check_profiles

            report, ok = check_profiles(config, path=os.environ.get("PATH"))
            self.stdout.write(f"config {config_path or '(none)'}\n{report}")
            sys.exit(0 if ok else 1)
        try:
            worker_options = WorkerOptions(
                server=options["server"] or "",
                poll_wait_s=min(LONG_POLL_MAX_S, env_float("RUNSTEAD_WORKER_POLL_S", LONG_POLL_MAX_S)),
                pull_idle_s=env_float("RUNSTEAD_WORKER_PULL_IDLE_S", WorkerOptions.pull_idle_s),
                once=options["once"],
                backoff_base_s=env_float("RUNSTEAD_WORKER_BACKOFF_BASE_S", WorkerOptions.backoff_base_s),
            )
        except SettingError as exc:
            raise CommandError(str(exc))
        try:
            worker = open_worker(state_dir=state_dir, config=config, options=worker_options)
        except StateDirLocked as exc:
            sys.stderr.write(f"runstead worker: {exc}\n")
            sys.exit(2)
        except RuntimeError as exc:
            raise CommandError(str(exc))
        if not worker.options.server:
            raise CommandError("--server is required (no server recorded at pairing)")
        worker.install_signal_handlers()
        code = worker.run()
        if code:
            sys.exit(code)

    def _prune(self, state_dir: str) -> None:
        """G7: ``integrate.prune`` on this state directory's store. Safe beside a running
        worker: it touches only integrations that are done."""
        from machine.worker.integrate import prune
        from machine.worker.store import StateDir, Store

        state = StateDir(state_dir)
        if not os.path.exists(state.db_path):
            self.stdout.write(f"no worker database in {state.path}: nothing to prune\n")
            return
        store = Store(state.db_path)
        try:
            removed = prune(store, out=lambda line: self.stdout.write(line + "\n"))
        finally:
            store.close()
        self.stdout.write(f"pruned: {removed} removed\n")

    def _service(self, options):
        """D4: write and load (or stop and remove) the login service for this command line."""
        from django.conf import settings

        from machine.worker import login_service

        out = lambda msg: self.stdout.write(msg)  # noqa: E731
        if options["uninstall_service"]:
            login_service.uninstall(out=out)
            return
        if options["once"] or options["check"]:
            raise CommandError("--install-service runs the worker loop: drop --once and --check")
        argv = [sys.executable, str(settings.BASE_DIR / "manage.py"), "worker",
                "--state-dir", os.path.abspath(os.path.expanduser(options["state_dir"]))]
        if options["server"]:
            argv += ["--server", options["server"]]
        if options["config"]:
            argv += ["--config", os.path.abspath(os.path.expanduser(options["config"]))]
        login_service.install(argv, workdir=str(settings.BASE_DIR), out=out)
