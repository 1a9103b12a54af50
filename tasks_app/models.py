"""Service-side state of RunStead tasks (SPEC 1, 2, A, P, L, R, J, U).

Every state change goes through ``tasks_app.services.transitions``; nothing else writes
``Task.state``. Seconds are floats; times are UTC.
"""
import uuid

from django.conf import settings
from django.db import models
from django.db.models import Q

from tasks_app.protocol import DEFAULT_MAX_RUNTIME_S


class Machine(models.Model):
    """A paired worker host (K1). ``generation`` rises on every re-pair; the token is stored
    as a SHA-256 hex digest."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="machines")
    name = models.CharField(max_length=200)
    generation = models.PositiveIntegerField(default=0)
    token_hash = models.CharField(max_length=64, blank=True, db_index=True)
    paired = models.BooleanField(default=False)
    unpaired_at = models.DateTimeField(null=True, blank=True)
    last_heard_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    version = models.PositiveBigIntegerField(default=1)
    # B10: the profile names and presets the worker last reported (PUT /api/worker/profiles/).
    profiles = models.JSONField(default=list, blank=True)
    profiles_reported_at = models.DateTimeField(null=True, blank=True)

    def __str__(self):
        return f"{self.name} (gen {self.generation})"


class PairingCode(models.Model):
    """A one-time pairing code (K1): stored hashed, expires, single use, attempts counted."""

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE)
    machine = models.ForeignKey(Machine, null=True, blank=True, on_delete=models.CASCADE)
    name = models.CharField(max_length=200, blank=True)
    code_hash = models.CharField(max_length=64, unique=True)
    expires_at = models.DateTimeField()
    used_at = models.DateTimeField(null=True, blank=True)
    attempts = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)


class PairingAttempt(models.Model):
    """One row per pairing attempt, counted in the database per client address (K1) to
    brake guessing without letting one client lock everyone out."""

    at = models.DateTimeField()
    client = models.CharField(max_length=64, default="")
    ok = models.BooleanField()

    class Meta:
        indexes = [models.Index(fields=["client", "at"], name="pairing_attempt_client_at")]


class Grant(models.Model):
    """Permission for one machine to work in ``path`` (absolute) and below it."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="grants")
    machine = models.ForeignKey(Machine, on_delete=models.CASCADE, related_name="grants")
    path = models.CharField(max_length=4096)
    created_at = models.DateTimeField(auto_now_add=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            # A folder is granted to a machine once at a time, so one revocation ends it.
            models.UniqueConstraint(
                fields=["machine", "path"], condition=Q(revoked_at__isnull=True), name="grant_one_active_per_path"
            )
        ]

    def __str__(self):
        return self.path


class Budget(models.Model):
    """Per-owner run-time budget in seconds; ``reserved_s + spent_s`` never exceeds
    ``limit_s`` through acceptance (checked under ``FOR UPDATE``)."""

    owner = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="budget")
    limit_s = models.FloatField()
    reserved_s = models.FloatField(default=0)
    spent_s = models.FloatField(default=0)

    class Meta:
        constraints = [
            models.CheckConstraint(condition=Q(reserved_s__gte=0), name="budget_reserved_nonnegative"),
        ]


class TaskState(models.TextChoices):
    ACCEPTED = "accepted"
    DELIVERED = "delivered"
    STARTING = "starting"
    RUNNING = "running"
    UNKNOWN = "unknown"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    FAILED_LEASE_LOST = "failed_lease_lost"
    CANCELLED = "cancelled"
    NOT_STARTED = "not_started"
    ABANDONED = "abandoned"


FINAL_STATES = frozenset(
    {
        TaskState.SUCCEEDED,
        TaskState.FAILED,
        TaskState.FAILED_LEASE_LOST,
        TaskState.CANCELLED,
        TaskState.NOT_STARTED,
        TaskState.ABANDONED,
    }
)
NEVER_LEASED_STATES = frozenset({TaskState.ACCEPTED, TaskState.DELIVERED})
LEASED_STATES = frozenset({TaskState.STARTING, TaskState.RUNNING})
UNFINISHED_STATES = frozenset(set(TaskState) - FINAL_STATES)


class Task(models.Model):
    """What the owner asked for, and what is known of how it went."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="tasks")
    machine = models.ForeignKey(Machine, on_delete=models.PROTECT, related_name="tasks")
    grant = models.ForeignKey(Grant, on_delete=models.PROTECT, related_name="tasks")
    session = models.ForeignKey(
        "sessions_app.Session", null=True, blank=True, on_delete=models.SET_NULL, related_name="tasks"
    )
    folder = models.CharField(max_length=4096)
    agent = models.CharField(max_length=100)
    prompt = models.TextField()
    deep_research = models.BooleanField(default=False)
    max_runtime_s = models.PositiveIntegerField(default=DEFAULT_MAX_RUNTIME_S)
    exclusive = models.BooleanField(default=True)

    state = models.CharField(max_length=20, choices=TaskState.choices, default=TaskState.ACCEPTED)
    state_reason = models.CharField(max_length=200, blank=True)
    # True while this task holds its folder lock (A8): exclusive and not final, or final
    # with survivors until the owner clears it (L8).
    holds_lock = models.BooleanField(default=False)
    reserved_s = models.FloatField(default=0)
    charged_s = models.FloatField(default=0)
    cancel_requested_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField()
    updated_at = models.DateTimeField()
    final_at = models.DateTimeField(null=True, blank=True)
    decided_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    decided_at = models.DateTimeField(null=True, blank=True)
    # Facts as reported (J1); kept as evidence (U4).
    pid = models.IntegerField(null=True, blank=True)
    process_start_time = models.FloatField(null=True, blank=True)
    exit_code = models.IntegerField(null=True, blank=True)
    signal = models.IntegerField(null=True, blank=True)
    stop_reason = models.CharField(max_length=40, blank=True)
    runtime_s = models.FloatField(null=True, blank=True)
    slept_s = models.FloatField(null=True, blank=True)
    survivors = models.JSONField(default=list, blank=True)
    output_tail = models.TextField(blank=True)
    facts = models.JSONField(null=True, blank=True)
    # G2/G3/G5: what the agent itself reported, and what changed in the repository.
    agent_session_id = models.CharField(max_length=200, blank=True)
    agent_result = models.JSONField(null=True, blank=True)  # {is_error, subtype, summary}
    usage = models.JSONField(null=True, blank=True)  # {turns, tool_calls, input_tokens, output_tokens, cost_usd}
    evidence = models.JSONField(default=dict, blank=True)  # {"git": {...}} or {}
    # G4: the latest live progress {seq, at, last_message, output_tail, usage}; never history.
    progress = models.JSONField(null=True, blank=True)
    progress_seq = models.PositiveBigIntegerField(default=0)
    # G6: the final task whose agent session this one continues.
    continued_from = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    version = models.PositiveBigIntegerField(default=1)

    class Meta:
        ordering = ["-created_at"]
        indexes = [
            # sweeps.expire_start_windows: never-leased tasks by age.
            models.Index(fields=["state", "created_at"], name="task_state_created"),
            # sweeps.cleanup_idempotency_records (A7): final tasks by age.
            models.Index(fields=["final_at"], condition=Q(final_at__isnull=False), name="task_final_at"),
            # acceptance A8: the lock holders of one machine.
            models.Index(fields=["machine"], condition=Q(holds_lock=True), name="task_lock_holders"),
        ]

    def __str__(self):
        return f"{self.agent} in {self.folder} ({self.state})"

    @property
    def is_final(self) -> bool:
        return self.state in FINAL_STATES


class TaskEvent(models.Model):
    """Append-only task history: every transition, and receipts that changed nothing."""

    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="events")
    old_state = models.CharField(max_length=20, blank=True)
    new_state = models.CharField(max_length=20, blank=True)
    reason = models.CharField(max_length=300, blank=True)
    actor = models.CharField(max_length=200)
    at = models.DateTimeField()

    class Meta:
        ordering = ["id"]


class Operation(models.Model):
    """The unit the worker executes at most once; its id is the worker's dedup key."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    task = models.OneToOneField(Task, on_delete=models.CASCADE, related_name="operation")
    created_at = models.DateTimeField()


class IdempotencyRecord(models.Model):
    """Per owner and key: digest of the canonical body and the stored response (A2)."""

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE)
    key = models.CharField(max_length=255)
    body_digest = models.CharField(max_length=64)
    response_status = models.PositiveSmallIntegerField()
    response_body = models.TextField()
    task = models.ForeignKey(Task, null=True, on_delete=models.CASCADE)
    created_at = models.DateTimeField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["owner", "key"], name="idempotency_owner_key")]


class MessageKind(models.TextChoices):
    START = "start"
    CANCEL = "cancel"
    QUERY = "query"


class OutboxMessage(models.Model):
    """A message for a machine, written in the transaction of the change it announces (W2)."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    machine = models.ForeignKey(Machine, on_delete=models.CASCADE, related_name="outbox")
    operation = models.ForeignKey(Operation, on_delete=models.CASCADE, related_name="messages")
    kind = models.CharField(max_length=10, choices=MessageKind.choices)
    payload = models.JSONField()
    created_at = models.DateTimeField()
    # Delivered again once visible_at passes without an ack.
    visible_at = models.DateTimeField()
    deliveries = models.PositiveIntegerField(default=0)
    acked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["created_at", "id"]
        indexes = [
            # messages_pull: unacked messages of one machine.
            models.Index(fields=["machine", "visible_at"], condition=Q(acked_at__isnull=True), name="outbox_pending"),
        ]


class Lease(models.Model):
    """Permission to keep running; at most one per operation, ever (L1)."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    operation = models.OneToOneField(Operation, on_delete=models.CASCADE, related_name="lease")
    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="leases")
    granted_at = models.DateTimeField()
    expires_at = models.DateTimeField()
    # The machine's generation at grant; renewals under another generation are refused (L2).
    generation = models.PositiveIntegerField(default=0)
    renewals = models.PositiveIntegerField(default=0)
    last_renewed_at = models.DateTimeField(null=True, blank=True)
    duration_s = models.FloatField()
    renew_every_s = models.FloatField()
    margin_s = models.FloatField()
    kill_grace_s = models.FloatField()
    # A refused renewal is final for the lease (L5); the lease still expires at expires_at.
    refused_reason = models.CharField(max_length=20, blank=True)
    # Set once, when the lease expires (L6) or its task's facts arrive.
    ended_at = models.DateTimeField(null=True, blank=True)
    end_reason = models.CharField(max_length=40, blank=True)

    class Meta:
        indexes = [
            # sweeps.expire_leases: live leases by expiry.
            models.Index(fields=["expires_at"], condition=Q(ended_at__isnull=True), name="lease_live_expiry"),
        ]


class Receipt(models.Model):
    """A report from the worker, stored once per (machine, event_id) with its answer (R1)."""

    machine = models.ForeignKey(Machine, on_delete=models.CASCADE, related_name="receipts")
    event_id = models.CharField(max_length=100)
    task = models.ForeignKey(Task, null=True, blank=True, on_delete=models.CASCADE, related_name="receipts")
    kind = models.CharField(max_length=20)
    generation = models.PositiveIntegerField()
    body = models.JSONField()
    response_status = models.PositiveSmallIntegerField()
    response_body = models.TextField()
    received_at = models.DateTimeField()

    class Meta:
        ordering = ["-received_at", "-id"]
        constraints = [models.UniqueConstraint(fields=["machine", "event_id"], name="receipt_machine_event")]
