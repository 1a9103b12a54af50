"""Chat sessions, their running markers and background jobs (SPEC M, S).

Times are UTC; durations are seconds. Status, markers and jobs change only through
``sessions_app.services``.
"""
import uuid

from django.conf import settings
from django.db import models
from django.db.models import Q


class SessionStatus(models.TextChoices):
    BUSY = "busy"
    IDLE = "idle"


class Attention(models.TextChoices):
    """I6: whether a session needs its owner."""

    NONE = "", "none"
    PERMISSION = "permission", "permission prompt"
    APPROVAL = "approval", "approval pending"  # Q3: set and cleared by the approvals, never by PATCH


class Channel(models.TextChoices):
    """T1: how an owner's message can reach a session: ``terminal`` (the terminal wrapper
    types it at the prompt, T3), ``hook`` (its Stop hook hands it over when the turn
    ends, T4), ``native`` (a CLI's own way in, T4), ``none`` (unreachable)."""

    TERMINAL = "terminal"
    HOOK = "hook"
    NATIVE = "native"
    NONE = "none"


class Session(models.Model):
    """A chat session. ``status`` is stored and changed only by compare-and-set (S2);
    ``version`` rises on every change of the row (B2).

    I6: ``agent`` (the CLI that reports it: ``claude``, ``codex``, ``gemini``,
    ``opencode``, or blank), ``cwd`` (its folder, absolute, or blank), ``attention``
    (``""``, ``permission``, or ``approval`` while one of its approvals is pending (Q3),
    with ``attention_message`` and ``attention_since``, UTC), changed by compare-and-set
    on ``version`` like the status."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="chat_sessions")
    title = models.CharField(max_length=300, blank=True)
    agent = models.CharField(max_length=20, blank=True, default="")
    cwd = models.CharField(max_length=1024, blank=True, default="")
    attention = models.CharField(max_length=20, choices=Attention.choices, blank=True, default=Attention.NONE)
    attention_message = models.CharField(max_length=500, blank=True, default="")
    attention_since = models.DateTimeField(null=True, blank=True)
    # T1: the paired machine the session runs on, and how a message reaches it there.
    machine = models.ForeignKey("tasks_app.Machine", null=True, blank=True, on_delete=models.SET_NULL,
                                related_name="sessions")
    channel = models.CharField(max_length=10, choices=Channel.choices, default=Channel.NONE)
    message_seq = models.PositiveIntegerField(default=0)  # T2: the last seq given
    status = models.CharField(max_length=10, choices=SessionStatus.choices, default=SessionStatus.IDLE)
    status_since = models.DateTimeField()
    created_at = models.DateTimeField()
    version = models.PositiveBigIntegerField(default=1)

    class Meta:
        ordering = ["-created_at"]
        indexes = [
            # services.sessions_sweep: busy sessions whose busy may have lapsed (S7, M3).
            models.Index(fields=["status_since"], condition=Q(status="busy"), name="session_busy_since"),
        ]

    def __str__(self):
        return self.title or str(self.id)


class MarkerState(models.TextChoices):
    RUNNING = "running"
    ENDED = "ended"


class Marker(models.Model):
    """One device's record of its current turn in one session (M1-M8).

    One row per (session, device) (M7); a new turn overwrites the row. Whether it shows
    RUNNING is decided on read (M3, ``rules.marker_is_running``); nothing deletes it.
    """

    session = models.ForeignKey(Session, on_delete=models.CASCADE, related_name="markers")
    device_id = models.CharField(max_length=200)
    device_name = models.CharField(max_length=200, blank=True)
    turn_id = models.CharField(max_length=100)
    state = models.CharField(max_length=10, choices=MarkerState.choices)
    deep_research = models.BooleanField(default=False)
    started_at = models.DateTimeField()
    expires_at = models.DateTimeField()
    ended_at = models.DateTimeField(null=True, blank=True)
    version = models.PositiveBigIntegerField(default=1)

    class Meta:
        ordering = ["session", "device_id"]
        constraints = [models.UniqueConstraint(fields=["session", "device_id"], name="marker_session_device")]
        indexes = [
            # services.device_sweep (M5): running markers of one device.
            models.Index(fields=["device_id"], condition=Q(state="running"), name="marker_running_device"),
        ]

    def __str__(self):
        return f"{self.device_id} {self.state} {self.turn_id}"


class EndedTurn(models.Model):
    """Append-only: the turns of a session that ended (M4), so a late ``running`` for an
    ended turn, or one that was overwritten by a newer turn, is never applied."""

    session = models.ForeignKey(Session, on_delete=models.CASCADE, related_name="ended_turns")
    turn_id = models.CharField(max_length=100)
    device_id = models.CharField(max_length=200)
    ended_at = models.DateTimeField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["session", "turn_id"], name="ended_turn_session_turn")]


class JobMode(models.TextChoices):
    HELD = "held"
    DETACHED = "detached"


class Job(models.Model):
    """Background work a session owns (S3, S4, S7).

    A held job counts toward busy while it is unfinished, or finished with ``wakes`` and
    not yet consumed by a later ``running`` marker, never past ``created_at +
    RUNSTEAD_JOB_HOLD_MAX_S``, and never once cancelled. A detached job never counts.
    """

    session = models.ForeignKey(Session, on_delete=models.CASCADE, related_name="jobs")
    job_id = models.CharField(max_length=200)
    mode = models.CharField(max_length=10, choices=JobMode.choices)
    auto_backgrounded = models.BooleanField(default=False)
    created_at = models.DateTimeField()
    finished_at = models.DateTimeField(null=True, blank=True)
    wakes = models.BooleanField(null=True, blank=True)
    consumed_at = models.DateTimeField(null=True, blank=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)
    version = models.PositiveBigIntegerField(default=1)

    class Meta:
        ordering = ["created_at", "id"]
        constraints = [models.UniqueConstraint(fields=["session", "job_id"], name="job_session_job")]

    def __str__(self):
        return f"{self.job_id} ({self.mode})"


class ApprovalState(models.TextChoices):
    """Q1. ``pending`` is the only state that changes, once, by compare-and-set (Q2)."""

    PENDING = "pending"
    ALLOWED = "allowed"
    DENIED = "denied"
    ANSWERED_IN_TERMINAL = "answered_in_terminal"
    EXPIRED = "expired"
    WITHDRAWN = "withdrawn"


class ApprovalScope(models.TextChoices):
    ONCE = "once"
    SESSION = "session"  # allow this and the same kind of call for the rest of the session


# Q1: decided_by values other than an owner (``owner:<username>``).
DECIDED_BY_TERMINAL = "terminal"
DECIDED_BY_TIMEOUT = "timeout"
DECIDED_BY_SYSTEM = "system"


class Approval(models.Model):
    """A tool call an agent asked its owner to approve (SPEC Q1).

    It belongs to an interactive ``session`` or to a headless ``task`` (exactly one;
    ``machine`` is the task's), is created once per (owner, ``key``) (the asking hook
    derives the key, so a retried request makes no second row) and leaves ``pending``
    once, by compare-and-set, only through ``sessions_app.approvals``. ``tool_input`` is
    the JSON as asked, cut to 4 KiB (``tool_input_truncated``), with the SHA-256 of the
    whole in ``tool_input_digest``; ``suggestions`` are the CLI's
    ``permission_suggestions`` (for "allow for this session"). ``decided_by`` is
    ``owner:<username>``, ``terminal``, ``timeout`` or ``system``; ``message`` a deny's
    instruction to the agent; ``scope`` ``once`` or ``session`` for an allow. Times UTC;
    ``expires_at`` is when a pending one becomes ``expired`` (``RUNSTEAD_APPROVAL_WAIT_S``
    after ``created_at``). ``version`` rises on every change (B2)."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="approvals")
    key = models.CharField(max_length=255)
    session = models.ForeignKey(Session, null=True, blank=True, on_delete=models.CASCADE, related_name="approvals")
    task = models.ForeignKey("tasks_app.Task", null=True, blank=True, on_delete=models.CASCADE, related_name="approvals")
    machine = models.ForeignKey("tasks_app.Machine", null=True, blank=True, on_delete=models.SET_NULL,
                                related_name="+")
    agent = models.CharField(max_length=20)
    tool_name = models.CharField(max_length=200)
    tool_input = models.JSONField(default=dict)
    tool_input_digest = models.CharField(max_length=64)
    tool_input_truncated = models.BooleanField(default=False)
    cwd = models.CharField(max_length=1024, blank=True, default="")
    suggestions = models.JSONField(default=list, blank=True)
    state = models.CharField(max_length=24, choices=ApprovalState.choices, default=ApprovalState.PENDING)
    created_at = models.DateTimeField()
    expires_at = models.DateTimeField()
    decided_at = models.DateTimeField(null=True, blank=True)
    decided_by = models.CharField(max_length=200, blank=True, default="")
    message = models.CharField(max_length=2000, blank=True, default="")
    scope = models.CharField(max_length=10, choices=ApprovalScope.choices, blank=True, default="")
    version = models.PositiveBigIntegerField(default=1)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.UniqueConstraint(fields=["owner", "key"], name="approval_owner_key"),
            models.CheckConstraint(
                condition=Q(session__isnull=False, task__isnull=True) | Q(session__isnull=True, task__isnull=False),
                name="approval_session_xor_task",
            ),
        ]
        indexes = [
            # approvals.approvals_expire (the sweep): pending approvals by expiry.
            models.Index(fields=["expires_at"], condition=Q(state="pending"), name="approval_pending_expiry"),
            # the owner's pending list and the board snapshot (B4, Q6).
            models.Index(fields=["owner", "created_at"], condition=Q(state="pending"), name="approval_pending_owner"),
        ]

    def __str__(self):
        return f"{self.tool_name} ({self.state})"


class SessionMessageState(models.TextChoices):
    """T2 (as C3, C10): ``sent`` (accepted), ``delivered`` (typed into the terminal or
    claimed by the Stop hook), ``answered`` (the turn it started or joined ended),
    ``undelivered`` (it can no longer reach the agent), ``withdrawn`` (by its owner)."""

    SENT = "sent"
    DELIVERED = "delivered"
    ANSWERED = "answered"
    UNDELIVERED = "undelivered"
    WITHDRAWN = "withdrawn"


class SessionMessage(models.Model):
    """One owner message to a terminal session (T2), numbered per session in acceptance
    order (``seq`` from 1). Its state only moves forward, by compare-and-set
    (``sessions_app.messages``); ``version`` rises on every change."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    session = models.ForeignKey(Session, on_delete=models.CASCADE, related_name="messages")
    seq = models.PositiveIntegerField()
    text = models.TextField()
    state = models.CharField(max_length=12, choices=SessionMessageState.choices, default=SessionMessageState.SENT)
    channel = models.CharField(max_length=10, choices=Channel.choices)  # the channel it was sent through
    delivered_by = models.CharField(max_length=200, blank=True, default="")
    created_at = models.DateTimeField()
    delivered_at = models.DateTimeField(null=True, blank=True)
    answered_at = models.DateTimeField(null=True, blank=True)
    # T6: the last assistant message of the turn that answered it (Claude Code's Stop hook).
    reply = models.TextField(blank=True, default="")
    version = models.PositiveBigIntegerField(default=1)

    class Meta:
        ordering = ["seq"]
        constraints = [models.UniqueConstraint(fields=["session", "seq"], name="session_message_seq")]
