"""Notification settings, push subscriptions, the deployment's VAPID key, and the
notification outbox (SPEC N1-N3). Times are UTC."""
import uuid

from django.conf import settings
from django.db import models
from django.db.models import Q


class Kind(models.TextChoices):
    """What an owner can be told about (N1, Q6). ``task_failed`` covers ``failed`` and
    ``failed_lease_lost``; ``approval`` is an agent asking (and, replacing it, the
    answer)."""

    SESSION_IDLE = "session_idle"
    ATTENTION = "attention"
    UNKNOWN = "unknown"
    TASK_SUCCEEDED = "task_succeeded"
    TASK_FAILED = "task_failed"
    APPROVAL = "approval"


KIND_NAMES = tuple(Kind.values)


def default_kinds() -> dict:
    return {name: True for name in KIND_NAMES}


class NotificationSettings(models.Model):
    """One owner's choices (N1, N2). Absent row = the defaults (every kind on, board and
    push on, no webhook); a kind missing from ``kinds`` (a row stored before the kind
    existed, e.g. ``approval``) is on. ``webhook_secret`` signs webhook bodies; it is shown once, when
    a new ``webhook_url`` is set."""

    owner = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="notification_settings")
    kinds = models.JSONField(default=default_kinds)
    board = models.BooleanField(default=True)
    push = models.BooleanField(default=True)
    webhook_url = models.URLField(max_length=2000, null=True, blank=True)
    webhook_secret = models.CharField(max_length=100, blank=True)
    updated_at = models.DateTimeField()

    def kind_on(self, kind: str) -> bool:
        return bool(self.kinds.get(kind, True))


class PushSubscription(models.Model):
    """One installed browser's Web Push subscription (N2): the browser's endpoint and its
    ECDH public key (``p256dh``) and auth secret, both base64url as the browser gives them."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="push_subscriptions")
    endpoint = models.URLField(max_length=2000)
    p256dh = models.CharField(max_length=200)
    auth = models.CharField(max_length=100)
    created_at = models.DateTimeField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["owner", "endpoint"], name="push_subscription_one_per_endpoint")]


class VapidKey(models.Model):
    """The deployment's VAPID key pair (one row, ``id = 1``), created on first use (N2).
    ``private_pem``: PKCS8 PEM of a P-256 key; ``public_key``: the uncompressed point,
    base64url, as browsers take it for ``applicationServerKey``."""

    id = models.PositiveSmallIntegerField(primary_key=True, default=1)
    private_pem = models.TextField()
    public_key = models.CharField(max_length=200)
    created_at = models.DateTimeField()

    class Meta:
        constraints = [models.CheckConstraint(condition=Q(id=1), name="vapid_key_single_row")]


class Notification(models.Model):
    """One notification event (N3), written in the transaction of the change it announces.
    ``id`` is the event id every channel carries (``X-RunStead-Delivery``, the push
    payload's ``id``); ``event_key`` names the change (e.g. ``task:<id>:succeeded``) and is
    unique, so one change is announced once however often its code path runs."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="notifications")
    kind = models.CharField(max_length=30, choices=Kind.choices)
    event_key = models.CharField(max_length=200, unique=True)
    payload = models.JSONField()
    created_at = models.DateTimeField()

    class Meta:
        ordering = ["-created_at"]


class Channel(models.TextChoices):
    PUSH = "push"
    WEBHOOK = "webhook"


class DeliveryStatus(models.TextChoices):
    PENDING = "pending"
    SENT = "sent"
    DROPPED = "dropped"


class Delivery(models.Model):
    """One notification to one target (a push subscription or the webhook URL), sent by
    the notify loop after commit (N3). ``next_attempt_at`` is when it is due; claiming it
    moves that forward by the claim window, so two loops never send it at once."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    notification = models.ForeignKey(Notification, on_delete=models.CASCADE, related_name="deliveries")
    channel = models.CharField(max_length=10, choices=Channel.choices)
    subscription = models.ForeignKey(PushSubscription, null=True, blank=True, on_delete=models.CASCADE, related_name="deliveries")
    url = models.URLField(max_length=2000, blank=True)
    status = models.CharField(max_length=10, choices=DeliveryStatus.choices, default=DeliveryStatus.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    next_attempt_at = models.DateTimeField()
    sent_at = models.DateTimeField(null=True, blank=True)
    dropped_at = models.DateTimeField(null=True, blank=True)
    last_error = models.CharField(max_length=300, blank=True)
    created_at = models.DateTimeField()

    class Meta:
        indexes = [
            # delivery.deliveries_claim: the due pending deliveries (the notify loop).
            models.Index(fields=["next_attempt_at"], condition=Q(status="pending"), name="delivery_pending_due"),
        ]
