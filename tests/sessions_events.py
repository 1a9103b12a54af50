"""Test helpers for the sessions tests: a channel layer that records what reaches each
owner's group, and a fixture that installs it.

``RecordingLayer`` is the real in-memory layer (messages are delivered as usual) that also
keeps every ``group_send`` it carries, so a test reads exactly which events reached which
owner's group, in order, after commit.
"""
import uuid
from datetime import datetime, timedelta, UTC

import pytest
from channels.layers import InMemoryChannelLayer, channel_layers

from sessions_app import services
from core.broadcast import owner_group

SENT: list[tuple[str, dict]] = []


class RecordingLayer(InMemoryChannelLayer):
    async def group_send(self, group, message):
        SENT.append((group, message))
        await super().group_send(group, message)


class BoardEvents:
    def clear(self):
        SENT.clear()

    def of(self, owner) -> list[dict]:
        """Events that reached ``owner``'s group, in order."""
        group = owner_group(owner.pk)
        return [e for g, m in SENT if g == group for e in (m["events"] if m["type"] == "board.events" else [m["event"]])]

    def statuses(self, owner, session_id) -> list[str]:
        """The ``session.status`` values published for one session, in order."""
        return [
            e["status"] for e in self.of(owner) if e["type"] == "session.status" and e["session_id"] == str(session_id)
        ]

    def markers(self, owner, session_id=None) -> list[dict]:
        return [
            e for e in self.of(owner)
            if e["type"] == "marker" and (session_id is None or e["session_id"] == str(session_id))
        ]

    def groups(self) -> set[str]:
        return {g for g, _ in SENT}


@pytest.fixture
def board_events(settings):
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "tests.sessions_events.RecordingLayer"}}
    channel_layers.backends.clear()
    SENT.clear()
    yield BoardEvents()
    SENT.clear()
    channel_layers.backends.clear()


T0 = datetime(2026, 3, 2, 9, 0, tzinfo=UTC)


class Board:
    """Drives the API as one owner; every call commits (captured on_commit callbacks run
    at the end of the call), as in a real request."""

    def __init__(self, client, capture):
        self.client = client
        self.capture = capture

    def _call(self, method, url, body=None):
        with self.capture(execute=True):
            response = getattr(self.client, method)(url, body, format="json")
        return response

    def marker(self, sid, turn, state, device="laptop", expect=200, **extra):
        response = self._call(
            "put", f"/api/sessions/{sid}/marker/", {"turn_id": turn, "device_id": device, "state": state, **extra}
        )
        assert response.status_code == expect, response.content
        return response.json()

    def job(self, sid, job_id, mode="held", expect=201, **extra):
        body = {"job_id": job_id, **extra}
        if mode is not None:
            body["mode"] = mode
        response = self._call("post", f"/api/sessions/{sid}/jobs/", body)
        assert response.status_code == expect, response.content
        return response.json()

    def finish(self, sid, job_id, wakes, expect=200):
        response = self._call("post", f"/api/sessions/{sid}/jobs/{job_id}/finish/", {"wakes": wakes})
        assert response.status_code == expect, response.content
        return response.json()

    def stop(self, sid, expect=200):
        response = self._call("post", f"/api/sessions/{sid}/stop/")
        assert response.status_code == expect, response.content
        return response.json()

    def active(self):
        with self.capture(execute=True):
            response = self.client.get("/api/sessions/active/")
        assert response.status_code == 200, response.content
        return response.json()

    def sweep(self, now):
        with self.capture(execute=True):
            return services.sessions_sweep(now=now)


@pytest.fixture
def board(owner_client, django_capture_on_commit_callbacks, board_events):
    return Board(owner_client, django_capture_on_commit_callbacks)


@pytest.fixture
def at(time_machine):
    """Pins the service clock: ``at(seconds)`` moves to T0 + seconds."""

    def move(seconds=0.0):
        time_machine.move_to(T0 + timedelta(seconds=seconds), tick=False)
        return T0 + timedelta(seconds=seconds)

    move(0)
    return move


def new_id():
    return str(uuid.uuid4())


def make_task(owner, machine, grant, session_id, state="accepted", **extra):
    from tasks_app.models import Operation, Task

    now = datetime.now(UTC)
    task = Task.objects.create(
        owner=owner, machine=machine, grant=grant, session_id=session_id, folder=grant.path, agent="claude",
        prompt="p", state=state, created_at=now, updated_at=now, **extra,
    )
    Operation.objects.create(task=task, created_at=now)
    return task
