"""The history run's faults (issue 42), on a seeded schedule.

- ``kill_daphne``: kill -9 one of the three daphnes, start it again on its port;
- ``kill_worker``: kill -9 a worker, start it again (X3 recovery; it never runs anything
  again);
- ``kill_agent``: kill -9 a live agent process (its run ends by its facts);
- ``kill_launcher``: kill -9 the launcher that holds a live conversation's agent (the real
  Claude Code's when one runs): the agent's input pipe goes with it (C3, X3);
- ``partition_short`` / ``partition_long``: a worker's link to the service dropped (open
  connections stop forwarding and stay open, as after a Wi-Fi drop; new ones too) for
  less, or more, than the lease (L, D1);
- ``redis_restart``: the run's own redis-server killed and started again on its port;
- ``pg_kill``: ``pg_terminate_backend`` of every other backend of the run's own database;
- ``clock_jump``: a worker's machine sleeps (simulated: ``machine.simulated_sleep``, its
  monotonic clock, the worker's and its launchers', stands still for 0.5-2 leases while
  wall time and the service go on): L3, L5's sleep case.

Each fault is recorded (``Recorder.fault``) with its start and end.
"""
from __future__ import annotations

import random
import socket
import subprocess
import threading
import time

from tests.proxies import BlackholeProxy
from tests.wait import wait_for

KINDS = ("kill_daphne", "kill_worker", "kill_agent", "kill_launcher", "partition_short", "partition_long",
         "redis_restart", "pg_kill", "clock_jump")


def schedule(seed: int, duration_s: float, *, every_s: float = 3.0, lease_s: float = 3.0) -> list[tuple]:
    """``[(at_s, kind, length_s)]``: a fault about every ``every_s`` seconds (jittered)
    in the run's first ``duration_s``, each kind once before any repeats, in a seeded
    order; partitions last 0.3-0.6 of the lease (short) or 1.5-2 leases (long)."""
    rng = random.Random(f"faults-{seed}")
    out, at, bag = [], every_s * rng.uniform(0.5, 1.0), []
    while at < duration_s:
        if not bag:
            bag = list(KINDS)
            rng.shuffle(bag)
        kind = bag.pop()
        length = {"partition_short": lease_s * rng.uniform(0.3, 0.6),
                  "partition_long": lease_s * rng.uniform(1.5, 2.0),
                  "clock_jump": lease_s * rng.uniform(0.5, 2.0)}.get(kind, rng.uniform(0.3, 1.5))
        out.append((round(at, 2), kind, round(length, 2)))
        at += every_s * rng.uniform(0.6, 1.4)
    return out


class Partition(BlackholeProxy):
    """The tests' blackholing proxy with a switch: while ``cut`` is set, every connection,
    open or new, forwards nothing and stays open; after ``heal()`` new connections pass
    (the holed ones stay dead, as half-open connections do)."""

    def __init__(self, port: int):
        self.cut = threading.Event()
        super().__init__(port)

    def cutting(self) -> bool:
        return self.cut.is_set()

    def partition(self) -> None:
        self.cut.set()
        for connection in list(self.connections):
            connection["holed"].set()

    def heal(self) -> None:
        self.cut.clear()


class OwnRedis:
    """A redis-server of the run's own on ``port`` (never a shared one), restartable."""

    def __init__(self, port: int, log_path):
        self.port, self.log_path = port, log_path
        self.process = None
        self.start()

    def start(self) -> None:
        log = open(self.log_path, "ab")
        self.process = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                         "--appendonly", "no"], stdout=log, stderr=subprocess.STDOUT)
        log.close()
        wait_for(self.pong, timeout_s=10, what=f"redis-server on {self.port} answering PING")

    def pong(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait(5)

    def restart(self, down_s: float = 0.0) -> None:
        self.kill()
        time.sleep(down_s)  # the outage itself is the fault: its length is part of the schedule
        self.start()


def pg_kill(admin_dsn: str, database: str) -> int:
    """``pg_terminate_backend`` of every backend of ``database`` but this one; how many."""
    import psycopg

    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        rows = conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s "
                            "AND pid <> pg_backend_pid()", (database,)).fetchall()
    return len(rows)
