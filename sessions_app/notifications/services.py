"""Notification services (SPEC N1-N3): settings, push subscriptions, the VAPID key, and
the emit functions that write a notification into the outbox in the caller's transaction.

The emit functions (``notify_session_idle``, ``notify_session_attention``,
``notify_task_state``) are called by the code that wins a state change, inside its
transaction: a rollback takes the notification back with the change. They never raise
for a channel problem and never send anything themselves; the board channel is a
broadcast after commit, push and webhook are ``Delivery`` rows for the notify loop
(``sessions_app.notifications.delivery``).
"""
import base64
import logging
import secrets
import threading
import uuid
from datetime import datetime

from django.db import IntegrityError, transaction

from config import clock
from config.errors import ApplicationError
from config.broadcast import broadcast
from sessions_app.notifications.models import (
    KIND_NAMES,
    Channel,
    Delivery,
    Kind,
    Notification,
    NotificationSettings,
    PushSubscription,
    VapidKey,
    default_kinds,
)

log = logging.getLogger("runstead.notify")

TITLE_MAX = 120
BODY_MAX = 300
# Task states that end a task with a notification, and the kind each one is (N1).
TASK_STATE_KINDS = {
    "unknown": Kind.UNKNOWN,
    "succeeded": Kind.TASK_SUCCEEDED,
    "failed": Kind.TASK_FAILED,
    "failed_lease_lost": Kind.TASK_FAILED,
}


# --- settings (N1) -----------------------------------------------------------------------


def settings_get(*, owner) -> NotificationSettings:
    """The owner's settings; an unsaved row with the defaults when none was stored."""
    row = NotificationSettings.objects.filter(owner=owner).first()
    if row is None:
        row = NotificationSettings(owner=owner, kinds=default_kinds(), board=True, push=True, webhook_url=None)
    return row


def settings_dict(row: NotificationSettings) -> dict:
    """The wire shape of ``GET/PUT /api/notifications/settings/`` (H): ``{"kinds":
    {kind: bool}, "webhook_url": str | null, "board": bool, "push": bool}``. Never the
    secret."""
    return {
        "kinds": {name: row.kind_on(name) for name in KIND_NAMES},
        "webhook_url": row.webhook_url or None,
        "board": row.board,
        "push": row.push,
    }


def settings_update(*, owner, kinds: dict, webhook_url: str | None, board: bool, push: bool, now: datetime) -> tuple[NotificationSettings, str | None]:
    """Replace the owner's settings (``PUT``). Returns ``(row, secret)``: ``secret`` is a
    fresh webhook secret (hex, 256 bits) when ``webhook_url`` changed to a new URL, else
    None; it is shown to the owner this once. Clearing the URL clears the secret."""
    with transaction.atomic():
        row, _ = NotificationSettings.objects.select_for_update().get_or_create(
            owner=owner, defaults={"updated_at": now, "kinds": default_kinds()}
        )
        secret = None
        if webhook_url is None:
            row.webhook_secret = ""
        elif webhook_url != row.webhook_url or not row.webhook_secret:
            secret = secrets.token_hex(32)
            row.webhook_secret = secret
        row.kinds = {name: bool(kinds[name]) for name in KIND_NAMES}
        row.webhook_url, row.board, row.push, row.updated_at = webhook_url, board, push, now
        row.save()
        return row, secret


# --- push subscriptions (N2) ---------------------------------------------------------------


def subscription_create(*, owner, endpoint: str, p256dh: str, auth: str, now: datetime) -> tuple[PushSubscription, bool]:
    """Store a browser's push subscription; idempotent on (owner, endpoint): the same
    endpoint again updates its keys. Returns ``(subscription, created)``. Raises
    ApplicationError 400 ``invalid_keys`` when ``p256dh`` is not a P-256 point or
    ``auth`` not 16 bytes (base64url)."""
    try:
        point = _b64url_decode(p256dh)
        secret = _b64url_decode(auth)
    except ValueError:
        point = secret = b""
    if len(point) != 65 or point[0] != 4 or len(secret) != 16:
        raise ApplicationError("invalid_keys", "keys.p256dh must be a P-256 public key and keys.auth 16 bytes, base64url")
    with transaction.atomic():
        sub, created = PushSubscription.objects.select_for_update().get_or_create(
            owner=owner, endpoint=endpoint, defaults={"p256dh": p256dh, "auth": auth, "created_at": now}
        )
        if not created and (sub.p256dh, sub.auth) != (p256dh, auth):
            sub.p256dh, sub.auth = p256dh, auth
            sub.save(update_fields=["p256dh", "auth"])
        return sub, created


def subscription_delete(*, owner, subscription_id: uuid.UUID) -> None:
    """Remove one of the owner's subscriptions; 404 ``not_found`` for a missing or another
    owner's id (K2). Its pending deliveries go with it."""
    deleted, _ = PushSubscription.objects.filter(pk=subscription_id, owner=owner).delete()
    if not deleted:
        raise ApplicationError("not_found", "no such subscription", status_code=404)


def subscription_dict(sub: PushSubscription) -> dict:
    return {"id": str(sub.id), "endpoint": sub.endpoint, "created_at": sub.created_at.isoformat()}


# --- VAPID (N2) ----------------------------------------------------------------------------


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _b64url_decode(text: str) -> bytes:
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (ValueError, TypeError) as exc:
        raise ValueError("not base64url") from exc


def vapid_key(*, now: datetime | None = None) -> VapidKey:
    """The deployment's VAPID key pair, created on first use and stored in the database,
    so every process of the deployment signs with the same key. Two processes creating it
    at once: the primary key lets one win; the other reads the winner's."""
    row = VapidKey.objects.filter(pk=1).first()
    if row is not None:
        return row
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    private = ec.generate_private_key(ec.SECP256R1())
    pem = private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode("ascii")
    public = private.public_key().public_bytes(serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint)
    try:
        with transaction.atomic():
            return VapidKey.objects.create(pk=1, private_pem=pem, public_key=_b64url(public), created_at=now or clock.now())
    except IntegrityError:
        return VapidKey.objects.get(pk=1)


# --- emitting (N1, N3) -----------------------------------------------------------------------

_wake_lock = threading.Lock()
_wakers: list = []


def add_waker(callback) -> None:
    """Register a callable run after the commit of every new notification (the embedded
    loop uses it to send at once instead of at its next poll)."""
    with _wake_lock:
        _wakers.append(callback)


def remove_waker(callback) -> None:
    with _wake_lock:
        if callback in _wakers:
            _wakers.remove(callback)


def _wake() -> None:
    with _wake_lock:
        callbacks = list(_wakers)
    for callback in callbacks:
        try:
            callback()
        except Exception:  # noqa: BLE001 - waking is a hint; the loop polls anyway
            log.exception("notify waker failed")


def notification_emit(*, owner_id, kind: str, event_key: str, title: str, body: str, url: str, subject: dict, now: datetime) -> Notification | None:
    """Write one notification event in the caller's transaction (N3), if the owner wants
    this ``kind``: a ``Notification`` row, a push ``Delivery`` per subscription (when
    push is on), a webhook ``Delivery`` (when a URL is set), and, when the board channel
    is on, a ``notification`` board event after commit. An ``event_key`` seen before
    writes nothing (returns None). Never raises for channel problems."""
    prefs = NotificationSettings.objects.filter(owner_id=owner_id).first()
    if prefs is not None and not prefs.kind_on(kind):
        return None
    if Notification.objects.filter(event_key=event_key).exists():
        return None
    payload = {
        "id": None,
        "kind": kind,
        "title": title[:TITLE_MAX],
        "body": body[:BODY_MAX],
        "url": url,
        "created_at": now.isoformat(),
        **subject,
    }
    try:
        with transaction.atomic():  # a savepoint: a concurrent twin loses here, not the caller
            notification = Notification.objects.create(owner_id=owner_id, kind=kind, event_key=event_key, payload=payload, created_at=now)
    except IntegrityError:
        return None
    payload["id"] = str(notification.id)
    Notification.objects.filter(pk=notification.pk).update(payload=payload)
    notification.payload = payload
    deliveries = []
    if prefs is None or prefs.push:
        for sub in PushSubscription.objects.filter(owner_id=owner_id):
            deliveries.append(Delivery(notification=notification, channel=Channel.PUSH, subscription=sub, next_attempt_at=now, created_at=now))
    if prefs is not None and prefs.webhook_url:
        deliveries.append(Delivery(notification=notification, channel=Channel.WEBHOOK, url=prefs.webhook_url, next_attempt_at=now, created_at=now))
    Delivery.objects.bulk_create(deliveries)
    if prefs is None or prefs.board:
        broadcast(owner_id, {"type": "notification", "notification": payload, "version": 1})
    if deliveries:
        transaction.on_commit(_wake, robust=True)
    return notification


def notify_session_idle(session, *, now: datetime) -> Notification | None:
    """N1: ``session`` just went busy -> idle by S2's compare-and-set (true idle by S3:
    the service never stores a blip). Call from the winning transaction, with the row's
    new ``version``."""
    title = session.title or f"Session {str(session.pk)[:8]}"
    return notification_emit(
        owner_id=session.owner_id, kind=Kind.SESSION_IDLE, event_key=f"session:{session.pk}:idle:{session.version}",
        title=f"{title} is idle", body="The agent has finished its turn.", url="/",
        subject={"session_id": str(session.pk)}, now=now,
    )


def notify_session_attention(session, *, now: datetime) -> Notification | None:
    """N1: ``session`` now needs its owner (I6 ``attention`` set); call from the
    transaction that set it, with the row's new ``version``."""
    title = session.title or f"Session {str(session.pk)[:8]}"
    message = getattr(session, "attention_message", "") or "The agent is waiting for you."
    return notification_emit(
        owner_id=session.owner_id, kind=Kind.ATTENTION, event_key=f"session:{session.pk}:attention:{session.version}",
        title=f"{title} needs you", body=message, url="/",
        subject={"session_id": str(session.pk)}, now=now,
    )


def notify_task_state(task, *, now: datetime) -> Notification | None:
    """N1: a task is now in ``task.state``; announces ``unknown`` ("needs your decision")
    and the ends ``succeeded``, ``failed``, ``failed_lease_lost``, once per task and state
    (the event key); other states write nothing. Call from the transaction of the
    transition (the ``tasks_app.signals.task_changed`` receiver)."""
    kind = TASK_STATE_KINDS.get(task.state)
    if kind is None:
        return None
    what = {"unknown": "needs your decision", "succeeded": "succeeded", "failed": "failed",
            "failed_lease_lost": "failed: lease lost"}[task.state]
    prompt = (task.prompt or "").strip().splitlines()[0] if (task.prompt or "").strip() else ""
    return notification_emit(
        owner_id=task.owner_id, kind=kind, event_key=f"task:{task.pk}:{task.state}",
        title=f"Task {what}", body=f"{task.agent} · {prompt}"[:BODY_MAX], url=f"/tasks/{task.pk}/",
        subject={"task_id": str(task.pk), "state": task.state}, now=now,
    )
