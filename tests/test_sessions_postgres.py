"""S2 across processes on PostgreSQL + Redis: a status change is published exactly once,
to the owner's group only, however many service processes re-evaluate it."""
import asyncio
import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from datetime import timedelta

import pytest
from channels.layers import channel_layers
from django.conf import settings
from django.db import connection, transaction

from core import clock
from sessions_app import services
from core.broadcast import owner_group
from sessions_app.models import Marker, Session
from tests.conftest import owner_api
from tests.live import database_env

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


class GroupReader:
    """A real channel in one owner's group on the Redis layer: its own layer instance on
    its own event loop thread (the layer's receive buffers are loop-bound)."""

    def __init__(self, owner):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.layer = channel_layers.make_backend("default")
        self.channel = self._run(self.layer.new_channel())
        self._run(self.layer.group_add(owner_group(owner.pk), self.channel))

    def _run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=30)

    def drain(self, quiet_s=1.0) -> list[dict]:
        async def receive_all():
            events = []
            while True:
                try:
                    message = await asyncio.wait_for(self.layer.receive(self.channel), quiet_s)
                except TimeoutError:
                    return events
                events.append(message["event"])

        return self._run(receive_all())

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(autouse=True)
def _fresh_layers():
    channel_layers.backends.clear()
    yield
    channel_layers.backends.clear()


def crashed_turn(owner, *, expired: bool) -> str:
    """A busy session whose only turn's device crashed (no ``ended``)."""
    sid = str(uuid.uuid4())
    answer = owner_api(owner).put(
        f"/api/sessions/{sid}/marker/", {"turn_id": "t", "device_id": "dead", "state": "running"}, format="json"
    )
    assert answer.status_code == 200
    if expired:
        past = clock.now() - timedelta(seconds=settings.RUNSTEAD_MARKER_GRACE_S + 1)
        Marker.objects.filter(session_id=sid).update(expires_at=past)
    return sid


def test_s2_many_processes_refreshing_one_change_publish_one_status_event(make_owner):
    owner, other = make_owner("pg-alice"), make_owner("pg-mallory")
    sid = crashed_turn(owner, expired=False)
    reader, other_reader = GroupReader(owner), GroupReader(other)
    reader.drain(quiet_s=0.3)
    Marker.objects.filter(session_id=sid).update(expires_at=clock.now() - timedelta(minutes=5))
    barrier = threading.Barrier(6)
    won, errors = [], []

    def service_process():
        try:
            barrier.wait()
            with transaction.atomic():
                won.append(services.session_refresh_status(session_id=sid, now=clock.now()))
        except Exception as error:  # reported below
            errors.append(error)
        finally:
            connection.close()

    threads = [threading.Thread(target=service_process) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    assert sorted(won) == [False] * 5 + [True]
    events = reader.drain()
    # Beside the status, going idle emits one N1 session_idle notification, also once.
    statuses = [e for e in events if e["type"] != "notification"]
    assert [(e["type"], e["session_id"], e["status"]) for e in statuses] == [("session.status", sid, "idle")]
    assert statuses[0]["version"] == Session.objects.get(pk=sid).version
    assert [e["notification"]["kind"] for e in events if e["type"] == "notification"] == ["session_idle"]
    assert other_reader.drain(quiet_s=0.2) == []


SWEEP_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import django
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    django.setup()
    from core import clock
    from django.db import connection
    from sessions_app.services import sessions_sweep
    connection.ensure_connection()  # connecting is not part of the race
    print("ready", flush=True)
    go = float(sys.stdin.readline())  # a wall-clock instant both processes start at
    while time.time() < go:
        time.sleep(0.001)
    print(sessions_sweep(now=clock.now()), flush=True)
    """
)


def test_s2_two_service_processes_sweeping_publish_one_status_event(make_owner):
    owner, other = make_owner("pg-bob"), make_owner("pg-eve")
    sids = [crashed_turn(owner, expired=True) for _ in range(3)]
    reader, other_reader = GroupReader(owner), GroupReader(other)
    reader.drain(quiet_s=0.3)
    env = {**os.environ, **database_env(), "RUNSTEAD_EMBEDDED_SWEEP": "0"}
    env.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SWEEP_SCRIPT], cwd=settings.BASE_DIR, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for _ in range(2)
    ]
    # Both have set Django up (each said so); then both get the same start instant, a
    # moment ahead, so their sweeps overlap.
    ready = [p.stdout.readline() for p in procs]
    assert ready == ["ready\n", "ready\n"], [p.communicate(timeout=30) for p in procs]
    go = f"{time.time() + 0.2}\n"
    for p in procs:
        p.stdin.write(go)
        p.stdin.flush()
    results = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    assert sum(int(out.strip()) for out, _ in results) == 3
    events = reader.drain()
    statuses = [e for e in events if e["type"] == "session.status"]
    assert sorted((e["session_id"], e["status"]) for e in statuses) == sorted((sid, "idle") for sid in sids)
    # N1: idle because a marker expired is shown, never announced (no notification).
    assert [e["type"] for e in events if e["type"] != "session.status"] == []
    assert {e.get("announced") for e in statuses} == {False}
    assert other_reader.drain(quiet_s=0.2) == []
    assert set(Session.objects.filter(pk__in=sids).values_list("status", flat=True)) == {"idle"}


def test_s2_marker_writes_racing_task_transitions_publish_each_change_once(owner, machine, grant):
    """Markers (session -> marker locks) and task transitions (task -> session) race on one
    session: no deadlock, the published statuses alternate (each change exactly once), the
    versions are the stored ones, and the final status matches the final facts."""
    from tasks_app.models import Task

    sid = str(uuid.uuid4())
    client = owner_api(owner)
    client.post("/api/sessions/", {"id": sid}, format="json")
    now = clock.now()
    task = Task.objects.create(
        owner=owner, machine=machine, grant=grant, session_id=sid, folder=grant.path, agent="a", prompt="p",
        state="succeeded", created_at=now, updated_at=now,
    )
    reader = GroupReader(owner)
    barrier = threading.Barrier(2)
    errors = []

    def device():
        try:
            barrier.wait()
            for i in range(15):
                for state in ("running", "ended"):
                    r = owner_api(owner).put(
                        f"/api/sessions/{sid}/marker/", {"turn_id": f"t{i}", "device_id": "d", "state": state},
                        format="json",
                    )
                    assert r.status_code == 200, r.content
        except Exception as error:  # reported below
            errors.append(error)
        finally:
            connection.close()

    def task_code():
        try:
            barrier.wait()
            for state in ["running", "succeeded"] * 15:
                with transaction.atomic():
                    locked = Task.objects.select_for_update().get(pk=task.pk)
                    Task.objects.filter(pk=locked.pk).update(state=state)
                    services.session_refresh_status(session_id=sid, now=clock.now())
        except Exception as error:  # reported below
            errors.append(error)
        finally:
            connection.close()

    threads = [threading.Thread(target=device), threading.Thread(target=task_code)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    # Two senders may deliver out of order; the board orders by version (B2).
    events = sorted((e for e in reader.drain() if e["type"] == "session.status"), key=lambda e: e["version"])
    statuses = [e["status"] for e in events]
    assert statuses and all(a != b for a, b in zip(statuses, statuses[1:]))
    assert statuses[0] == "busy" and statuses[-1] == "idle"
    versions = [e["version"] for e in events]
    assert versions == list(range(2, 2 + len(versions)))  # every stored change published once
    session = Session.objects.get(pk=sid)
    assert (session.status, session.version) == ("idle", versions[-1])
