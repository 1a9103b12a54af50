"""Test helpers for the sessions tests: a channel layer that records what reaches each
owner's group, and a fixture that installs it.

``RecordingLayer`` is the real in-memory layer (messages are delivered as usual) that also
keeps every ``group_send`` it carries, so a test reads exactly which events reached which
owner's group, in order, after commit.
"""
import pytest
from channels.layers import InMemoryChannelLayer, channel_layers

from sessions_app.broadcast import owner_group

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
        return [m["event"] for g, m in SENT if g == group]

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
