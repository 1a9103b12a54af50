#!/usr/bin/env python
"""The history checker's long run, by hand (issue 42; ``tests/history/``).

Runs the seeded history run (``tests.history.runner.Run``: PostgreSQL + the run's own
Redis, three daphnes behind one address, two or more real workers, the client mix, the
seeded faults, and unless ``--no-claude`` one live conversation with the real Claude
Code offline) for ``--duration`` seconds on a scratch database ``history_<pid>`` of
``DATABASE_URL``'s server (created, migrated, dropped afterwards), then checks the record
(``tests.history.checker``): prints the run's figures and every violation with its
timeline, and exits 1 on any. The record and the processes' logs stay in ``--out``
(default a new temporary directory, printed); ``python -m tests.history.checker RECORD``
checks it again.

Usage::

    DATABASE_URL=postgresql://runstead:runstead@127.0.0.1:5432/runstead \\
    REDIS_URL=redis://127.0.0.1:6390/0 .venv/bin/python bench/history.py --seed 7 --duration 1800
"""
import argparse
import sys
import tempfile
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(BASE_DIR))

from harness import scratch_service  # noqa: E402  (bench/harness.py: a scratch database, migrated)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of client mix and faults")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--fault-every", type=float, default=4.0, help="mean seconds between faults")
    parser.add_argument("--settle", type=float, default=120.0, help="longest wait for every task to settle")
    parser.add_argument("--claude", action=argparse.BooleanOptionalAction, default=True,
                        help="one live conversation with the real Claude Code offline (var/agent-clis)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix=f"history-{args.seed}-"))
    out.mkdir(parents=True, exist_ok=True)
    with scratch_service("postgres", "history"):  # yields (env, dbname, admin_url): the run reads its own
        from tests.history.checker import check, timeline
        from tests.history.record import load
        from tests.history.runner import Run

        work = Path(tempfile.mkdtemp(prefix="history-", dir=out))
        run = Run(work, seed=args.seed, duration_s=args.duration, workers=args.workers, clients=args.clients,
                  fault_every_s=args.fault_every, settle_s=args.settle, claude=args.claude)
        record = run.go()
    lines = load(record)
    found = check(lines)
    print(run.summary())
    print(f"record: {record}")
    print(f"checker: {len(found)} violation(s)")
    for violation in found:
        print(violation)
        print(timeline(lines, violation))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
