"""Notification services (SPEC N1-N3): settings, push subscriptions, the VAPID key, and
the emit functions that write a notification into the outbox in the caller's transaction.

The emit functions (``notify_session_idle``, ``notify_session_attention``,
``notify_task_state``, ``notify_approval``) are called by the code that wins a state change, inside its
transaction: a rollback takes the notification back with the change. They never raise
for a channel problem and never send anything themselves; the board channel is a
broadcast after commit, push and webhook are ``Delivery`` rows for the notify loop
(``notifications.delivery``).
"""
import base64
import json
import logging
import secrets
import threading
import uuid
from datetime import datetime, timedelta

from django.db import IntegrityError, connection, transaction

from core import clock
from core.errors import ApplicationError
from core.broadcast import broadcast
from notifications import outbound
from notifications.models import (
    KIND_NAMES,
    Channel,
    Delivery,
    DeliveryStatus,
    Kind,
    Notification,
    NotificationSettings,
    PushSubscription,
    VapidKey,
    default_kinds,
)
from notifications.shapes import notification_event

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


def settings_update(*, owner, kinds: dict, webhook_url: str | None, board: bool, push: bool, now: datetime) -> tuple[NotificationSettings, str | None]:
    """Replace the owner's settings (``PUT``). Returns ``(row, secret)``: ``secret`` is a
    fresh webhook secret (hex, 256 bits) when ``webhook_url`` changed to a new URL, else
    None; it is shown to the owner this once. Clearing the URL clears the secret. Raises
    ApplicationError 400 ``url_not_allowed`` for a URL K5 refuses (checked before the
    transaction: resolving a name holds no row lock)."""
    if webhook_url is not None:
        outbound.url_check(webhook_url)
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
        # A kind the body leaves out (only ``approval`` may be) keeps its stored value.
        row.kinds = {name: bool(kinds[name]) if name in kinds else row.kind_on(name) for name in KIND_NAMES}
        row.webhook_url, row.board, row.push, row.updated_at = webhook_url, board, push, now
        row.save()
        return row, secret


# --- push subscriptions (N2) ---------------------------------------------------------------


def subscription_create(*, owner, endpoint: str, p256dh: str, auth: str, now: datetime) -> tuple[PushSubscription, bool]:
    """Store a browser's push subscription; idempotent on (owner, endpoint): the same
    endpoint again updates its keys. Returns ``(subscription, created)``. Raises
    ApplicationError 400 ``invalid_keys`` when ``p256dh`` is not a P-256 point or
    ``auth`` not 16 bytes (base64url), 400 ``url_not_allowed`` for an endpoint K5
    refuses."""
    try:
        point = _b64url_decode(p256dh)
        secret = _b64url_decode(auth)
    except ValueError:
        point = secret = b""
    if len(point) != 65 or point[0] != 4 or len(secret) != 16:
        raise ApplicationError("invalid_keys", "keys.p256dh must be a P-256 public key and keys.auth 16 bytes, base64url")
    outbound.url_check(endpoint)
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


# PostgreSQL: new deliveries are announced on this channel (``NOTIFY`` in the transaction
# that writes them, delivered to listeners when it commits), so the loops of every process
# send at once and need not poll the table every second (``delivery.listen_for_deliveries``).
DELIVERIES_CHANNEL = "runstead_deliveries"


def announce_deliveries() -> None:
    """In the current transaction: tell every process's notify loop that deliveries were
    written (PostgreSQL ``NOTIFY``, sent on commit and dropped on rollback, several in one
    transaction folded into one). Other databases: nothing (the embedded SQLite default
    is one process; its loop is woken by ``wake_loops`` and polls)."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(f"NOTIFY {DELIVERIES_CHANNEL}")


def add_waker(callback) -> None:
    """Register a callable run after the commit of every new notification (the embedded
    loop uses it to send at once instead of at its next poll)."""
    with _wake_lock:
        _wakers.append(callback)


def remove_waker(callback) -> None:
    with _wake_lock:
        if callback in _wakers:
            _wakers.remove(callback)


def wake_loops() -> None:
    """Run this process's wakers (``add_waker``): a delivery is due now or sooner than a
    loop thought (a new one committed, a retry scheduled)."""
    with _wake_lock:
        callbacks = list(_wakers)
    for callback in callbacks:
        try:
            callback()
        except Exception:  # noqa: BLE001 - waking is a hint; the loop polls anyway
            log.exception("notify waker failed")


def notification_emit(*, owner_id, kind: str, event_key: str, title: str, body: str, url: str, subject: dict, now: datetime,
                      targets: dict | None = None) -> Notification | None:
    """Write one notification event in the caller's transaction (N3), if the owner wants
    this ``kind``: a ``Notification`` row, a push ``Delivery`` per subscription (when
    push is on), a webhook ``Delivery`` (when a URL is set), and, when the board channel
    is on, a ``notification`` board event after commit. An ``event_key`` seen before
    writes nothing (returns None). Never raises for channel problems.

    ``targets`` narrows the deliveries to some of those: ``{("push", subscription id) |
    ("webhook", url): due datetime}`` (Q6: an answer goes where its question went);
    None means every target, due ``now``."""
    prefs = NotificationSettings.objects.filter(owner_id=owner_id).first()
    if prefs is not None and not prefs.kind_on(kind):
        return None
    notification_id = uuid.uuid4()  # in the payload from the first write: one INSERT, no UPDATE
    payload = {
        "id": str(notification_id),
        "kind": kind,
        "title": title[:TITLE_MAX],
        "body": body[:BODY_MAX],
        "url": url,
        "created_at": now.isoformat(),
        **subject,
    }
    try:
        # A savepoint: an event key seen before (a code path run again, or a concurrent
        # twin) loses here, not the caller's transaction.
        with transaction.atomic():
            notification = Notification.objects.create(id=notification_id, owner_id=owner_id, kind=kind,
                                                        event_key=event_key, payload=payload, created_at=now)
    except IntegrityError:
        return None
    deliveries = []

    def due(target):
        return now if targets is None else targets.get(target)

    if prefs is None or prefs.push:
        for sub in PushSubscription.objects.filter(owner_id=owner_id):
            if (at := due((Channel.PUSH, sub.pk))) is not None:
                deliveries.append(Delivery(notification=notification, channel=Channel.PUSH, subscription=sub, next_attempt_at=at, created_at=now))
    if prefs is not None and prefs.webhook_url and (at := due((Channel.WEBHOOK, prefs.webhook_url))) is not None:
        deliveries.append(Delivery(notification=notification, channel=Channel.WEBHOOK, url=prefs.webhook_url, next_attempt_at=at, created_at=now))
    Delivery.objects.bulk_create(deliveries)
    if prefs is None or prefs.board:
        broadcast(owner_id, notification_event(payload))
    if deliveries:
        announce_deliveries()
        transaction.on_commit(wake_loops, robust=True)
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
    once its owner is asked (``decision_asked_at``: U2 left it unsettled; an ``unknown``
    task the worker's late receipts may still settle asks nobody) and the ends
    ``succeeded``, ``failed``, ``failed_lease_lost``, once per task and state (the event
    key); other states write nothing. Call from the transaction of the
    transition (``sessions_app.receivers.notify_task_changed``)."""
    kind = TASK_STATE_KINDS.get(task.state)
    if kind is None:
        return None
    if task.state == "unknown" and task.decision_asked_at is None:
        return None  # N1, U2: the worker's record may still settle it; nobody is asked yet
    what = {"unknown": "needs your decision", "succeeded": "succeeded", "failed": "failed",
            "failed_lease_lost": "failed: lease lost"}[task.state]
    prompt = (task.prompt or "").strip().splitlines()[0] if (task.prompt or "").strip() else ""
    return notification_emit(
        owner_id=task.owner_id, kind=kind, event_key=f"task:{task.pk}:{task.state}",
        title=f"Task {what}", body=f"{task.agent} · {prompt}"[:BODY_MAX], url=f"/tasks/{task.pk}/",
        subject={"task_id": str(task.pk), "state": task.state}, now=now,
    )


# --- approvals (Q6) ----------------------------------------------------------------------------

# An answer whose question may still be on its way to a target (a send claimed or being
# retried) waits out one send (``delivery.SEND_TIMEOUT_S`` = 10 s) so it cannot overtake it.
ANSWER_AFTER_IN_FLIGHT_S = 11.0
PREVIEW_MAX = 200
_APPROVAL_ENDS = {
    "allowed": "allowed",
    "denied": "denied",
    "answered_in_terminal": "answered in the terminal",
    "expired": "expired: nobody answered in time",
    "withdrawn": "withdrawn: the task ended",
}


def approval_preview(tool_input) -> str:
    """The line a person decides on: a shell command, else a file path, else the input as
    compact JSON; one line, at most ``PREVIEW_MAX`` characters."""
    if isinstance(tool_input, dict):
        for name in ("command", "file_path", "path", "url", "pattern"):
            if isinstance(tool_input.get(name), str) and tool_input[name].strip():
                text = tool_input[name]
                break
        else:
            text = json.dumps(tool_input, separators=(",", ":"), ensure_ascii=False)
    else:
        text = json.dumps(tool_input, separators=(",", ":"), ensure_ascii=False)
    text = " ".join(text.split())
    return text if len(text) <= PREVIEW_MAX else text[: PREVIEW_MAX - 1] + "…"


def _approval_key(approval, what: str) -> str:
    return f"approval:{approval.pk}:{what}"


def notify_approval(approval, *, title: str, now: datetime) -> Notification | None:
    """Q6: kind ``approval``, one per approval id (event key ``approval:<id>:asked``).

    ``approval`` is a ``sessions_app`` Approval (read by attribute: this app sits below
    that one) as it stands after the change, ``title`` what it is about (its session's
    title or its task's prompt). Pending: "<tool> waits for your approval", with the
    input's preview, to every target. Decided (any state after ``pending``, which never
    changes again): the question's deliveries not yet attempted are dropped
    (``superseded``), and, when the question was written, one answer
    (``approval:<id>:decided``) goes to the board and to the targets the question may
    have reached (after ``ANSWER_AFTER_IN_FLIGHT_S`` where its send may still be under
    way). Both carry ``tag`` = the approval id, which a device uses to replace the
    question by the answer (static/sw.js, static/notify.js), and push services as the
    ``Topic`` (``delivery.send_push``). Call in the transaction of the change, once per
    change; returns the notification written, or None."""
    subject = {"approval_id": str(approval.pk), "approval_state": approval.state, "tag": str(approval.pk)}
    if approval.session_id is not None:
        subject["session_id"] = str(approval.session_id)
    else:
        subject["task_id"] = str(approval.task_id)
    url = f"/tasks/{approval.task_id}/" if approval.task_id is not None else "/"
    folder = (approval.cwd or "").rstrip("/").rsplit("/", 1)[-1]
    where = " · ".join(dict.fromkeys(part for part in (title, folder) if part))  # a session named after its folder: once
    if approval.state == "pending":
        return notification_emit(
            owner_id=approval.owner_id, kind=Kind.APPROVAL, event_key=_approval_key(approval, "asked"),
            title=f"{approval.tool_name} waits for your approval", url=url, subject=subject, now=now,
            body=f"{where}\n{approval_preview(approval.tool_input)}" if where else approval_preview(approval.tool_input),
        )
    asked = Notification.objects.filter(event_key=_approval_key(approval, "asked")).first()
    if asked is None:  # never asked (the kind was off): nothing to replace
        return None
    targets = {}
    for sent in asked.deliveries.exclude(status=DeliveryStatus.PENDING, attempts=0):
        target = (Channel.PUSH, sent.subscription_id) if sent.channel == Channel.PUSH else (Channel.WEBHOOK, sent.url)
        in_flight = sent.status == DeliveryStatus.PENDING
        targets[target] = now + timedelta(seconds=ANSWER_AFTER_IN_FLIGHT_S) if in_flight else now
    asked.deliveries.filter(status=DeliveryStatus.PENDING).update(
        status=DeliveryStatus.DROPPED, dropped_at=now, last_error="superseded: the approval was decided (Q6)")
    end = _APPROVAL_ENDS.get(approval.state, approval.state)
    who = approval.decided_by.split(":", 1)[1] if approval.decided_by.startswith("owner:") else ""
    if approval.state == "allowed" and approval.scope == "session":
        end += " for the session" if approval.session_id is not None else " for the run"
    return notification_emit(
        owner_id=approval.owner_id, kind=Kind.APPROVAL, event_key=_approval_key(approval, "decided"),
        title=f"{approval.tool_name}: {end}", url=url, subject=subject, now=now, targets=targets,
        body=(f"by {who}" + (f": {approval.message}" if approval.message else "")) if who else where,
    )
