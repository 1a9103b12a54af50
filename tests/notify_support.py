"""Helpers for the notification tests (SPEC N1, N2, K5): settings bodies, a browser's
Web Push keys and subscription, a session turn on the board, local receivers."""
import base64
import os

import pytest

from tests.http_receiver import Receiver

ALL_ON = {"session_idle": True, "attention": True, "unknown": True, "task_succeeded": True, "task_failed": True,
          "approval": True}


def b64url(data: bytes) -> str:
    """Base64url without padding (Web Push keys, JWT parts)."""
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def unb64url(text: str) -> bytes:
    """The inverse of ``b64url``."""
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def put_settings(client, **changes):
    """``PUT /api/notifications/settings/``: every kind on, board and push, no webhook,
    then ``changes``."""
    body = {"kinds": dict(ALL_ON), "webhook_url": None, "board": True, "push": True, **changes}
    return client.put("/api/notifications/settings/", body, format="json")


def turn(board, sid, name="t1"):
    """A whole turn of session ``sid`` on ``board`` (tests/sessions_events.py): running, ended."""
    board.marker(sid, name, "running")
    board.marker(sid, name, "ended")


def browser_keys():
    """A browser's Web Push keys: ``(private key, {"p256dh", "auth"} as sent, auth bytes)``."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    private = ec.generate_private_key(ec.SECP256R1())
    public = private.public_key().public_bytes(serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint)
    auth = os.urandom(16)
    return private, {"p256dh": b64url(public), "auth": b64url(auth)}, auth


def subscribe(client, endpoint, keys):
    """``POST /api/push/subscriptions/`` for ``endpoint`` with ``keys``."""
    return client.post("/api/push/subscriptions/", {"endpoint": endpoint, "expirationTime": None, "keys": keys}, format="json")


@pytest.fixture
def receiver(settings):
    """Local receivers on 127.0.0.1, which K5 lets the notify loop reach only through
    the allow list (as a deployment would list an internal ntfy)."""
    settings.RUNSTEAD_OUTBOUND_ALLOW = ["127.0.0.0/8"]
    made = []

    def make(answers=(200,)):
        r = Receiver(answers)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()
