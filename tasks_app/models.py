"""Service-side state of RunStead tasks (SPEC 1, 2, A, P, L, R, J, U).

Every state change goes through ``tasks_app.services.transitions``; nothing else writes
``Task.state``. Seconds are floats; times are UTC.
"""
import uuid

from django.conf import settings
from django.db import models
from django.db.models import Q

from machine.protocol import DEFAULT_MAX_RUNTIME_S


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
    # C8: what the worker reported with its profiles: its ``max_concurrent`` (W8; null:
    # never reported, so acceptance picks it for no ``"machine": "any"`` task) and the
    # identity of the git repositories under its allowed roots
    # (``[{"path", "remote", "root_commit"}]``, ``machine/worker/repositories.py``).
    max_concurrent = models.PositiveIntegerField(null=True, blank=True)
    repositories = models.JSONField(default=list, blank=True)

    def __str__(self):
        return f"{self.name} (gen {self.generation})"


class Pool(models.Model):
    """An owner-named set of machines (C8): a task may name the pool instead of a machine,
    and acceptance picks among its members by the rules of ``"machine": "any"``
    (``services.machine_choice``). Names are the owner's own: unique per owner, never
    ``any`` nor shaped like a machine id (``services.pools.POOL_NAME``)."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="pools")
    name = models.CharField(max_length=64)
    machines = models.ManyToManyField(Machine, related_name="pools", blank=True)
    created_at = models.DateTimeField()
    updated_at = models.DateTimeField()
    # B2: rises on every change (its name or its machines), and once more on deletion
    # (the ``pool.deleted`` event), so a board orders the ``pool`` events it receives.
    version = models.PositiveBigIntegerField(default=1)

    class Meta:
        ordering = ["name"]
        constraints = [models.UniqueConstraint(fields=["owner", "name"], name="pool_owner_name")]

    def __str__(self):
        return self.name


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
    QUEUED = "queued"  # G8: a follow-up waiting for the task it follows to be final
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
    # C8: "any", or the name of the owner's pool the task named, when acceptance picked
    # ``machine`` (and ``folder``, that machine's path of the same repository); "" when
    # the owner named the machine. Never changes (the pool may be renamed or deleted since).
    machine_choice = models.CharField(max_length=64, blank=True, default="")
    agent = models.CharField(max_length=100)
    prompt = models.TextField()
    deep_research = models.BooleanField(default=False)
    max_runtime_s = models.PositiveIntegerField(default=DEFAULT_MAX_RUNTIME_S)
    exclusive = models.BooleanField(default=True)
    # G7: "worktree" runs on a branch of its own in a git worktree (no folder lock, A8);
    # the task's value, else its profile's as the worker reported it, else "none".
    isolation = models.CharField(max_length=10, choices=[("none", "none"), ("worktree", "worktree")], default="none")
    # C1: "conversation" keeps the agent open between turns; ``conversation`` says how
    # its messages reach the agent: "live" (the CLI's streaming input), "resume" (each
    # message a follow-up, G6), "" for a plain task. ``conversation_ended_at``: the owner
    # asked to end it (C5), or nothing more is accepted for it.
    mode = models.CharField(max_length=12, choices=[("task", "task"), ("conversation", "conversation")],
                            default="task")
    conversation = models.CharField(max_length=6, blank=True, default="")
    conversation_ended_at = models.DateTimeField(null=True, blank=True)
    message_seq = models.PositiveIntegerField(default=0)  # C2: the last seq handed out

    state = models.CharField(max_length=20, choices=TaskState.choices, default=TaskState.ACCEPTED)
    state_reason = models.CharField(max_length=200, blank=True)
    # True while this task holds its folder lock (A8): exclusive and not final, or final
    # with survivors until the owner clears it (L8).
    holds_lock = models.BooleanField(default=False)
    reserved_s = models.FloatField(default=0)
    charged_s = models.FloatField(default=0)
    cancel_requested_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField()
    # J5: when it became ``accepted`` (its start window opens then): acceptance, or for a
    # queued follow-up its promotion (G8); null while queued.
    accepted_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField()
    final_at = models.DateTimeField(null=True, blank=True)
    # N1, U2: an ``unknown`` task waits for the worker's record first; its owner is asked
    # (notified, and it is listed first) only when U2 leaves it unsettled: the report had
    # no final facts, or none came by ``decision_due_at`` (the query plus
    # RUNSTEAD_UNKNOWN_ASK_S). ``decision_asked_at``: when that happened (set once).
    decision_due_at = models.DateTimeField(null=True, blank=True)
    decision_asked_at = models.DateTimeField(null=True, blank=True)
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
    # G4: the latest live progress {seq, at, last_message, output_tail, usage, entries}
    # (entries: those that post added; the transcript is TranscriptEntry); never history.
    progress = models.JSONField(null=True, blank=True)
    progress_seq = models.PositiveBigIntegerField(default=0)
    # G6: the final task whose agent session this one continues.
    continued_from = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    # G8: the unfinished task this follow-up waits for while ``queued`` (the previous
    # link of its chain; kept afterwards as history). At most one task queues behind
    # another: a later follow-up queues behind the last of the chain.
    queued_behind = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL,
                                      related_name="queued_followers")
    # G7, G8: the worktree task whose worktree and branch this follow-up continues (the
    # first of the branch); null for a task that makes its own branch or runs in place.
    branch_of = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    # Q5: "approval" while one of the task's approvals is pending (cleared when final);
    # the counts of its approvals (asked; allowed and denied by the owner); the SHA-256
    # of the per-task approval credential issued with the lease (blank: none issued).
    attention = models.CharField(max_length=20, blank=True, default="")
    approvals_asked = models.PositiveIntegerField(default=0)
    approvals_allowed = models.PositiveIntegerField(default=0)
    approvals_denied = models.PositiveIntegerField(default=0)
    approval_token_hash = models.CharField(max_length=64, blank=True, default="", db_index=True)
    version = models.PositiveBigIntegerField(default=1)

    class Meta:
        ordering = ["-created_at"]
        indexes = [
            # B11's state filter; sweeps.expire_start_windows uses task_state_accepted.
            models.Index(fields=["state", "created_at"], name="task_state_created"),
            # sweeps.expire_start_windows (J5): never-leased tasks by when they were accepted.
            models.Index(fields=["state", "accepted_at"], name="task_state_accepted"),
            # sweeps.cleanup_idempotency_records (A7): final tasks by age.
            models.Index(fields=["final_at"], condition=Q(final_at__isnull=False), name="task_final_at"),
            # sweeps.ask_owners_of_unsettled_tasks (N1, U2): unknown tasks not yet asked, by when they are due.
            models.Index(fields=["decision_due_at"], condition=Q(state="unknown", decision_asked_at__isnull=True),
                         name="task_decision_due"),
            # acceptance A8: the lock holders of one machine.
            models.Index(fields=["machine"], condition=Q(holds_lock=True), name="task_lock_holders"),
        ]

    def __str__(self):
        return f"{self.agent} in {self.folder} ({self.state})"


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


class TranscriptEntry(models.Model):
    """One entry of a task's transcript (G4, B9) as the worker numbered it: ``n`` from 1,
    ``data`` the entry ``{n, kind, text, tool?, status?, call?, usage?, seq?}``. Each ``n`` is
    kept once; the service keeps the last ``ENTRIES_KEPT`` of a task
    (``tasks_app.services.progress.transcript_append``)."""

    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="transcript")
    n = models.PositiveBigIntegerField()
    data = models.JSONField()

    class Meta:
        ordering = ["task", "n"]
        constraints = [models.UniqueConstraint(fields=["task", "n"], name="transcript_task_n")]


class Operation(models.Model):
    """The unit the worker executes at most once; its id is the worker's dedup key."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    task = models.OneToOneField(Task, on_delete=models.CASCADE, related_name="operation")
    created_at = models.DateTimeField()


class IdempotencyRecord(models.Model):
    """Per owner, scope and key: digest of the canonical body and the stored response (A2,
    Q2). ``scope`` names the operation the key belongs to (``task`` for acceptance,
    ``approval:<id>`` for a decision; ``core.idempotency``)."""

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE)
    scope = models.CharField(max_length=100, default="task")
    key = models.CharField(max_length=255)
    body_digest = models.CharField(max_length=64)
    response_status = models.PositiveSmallIntegerField()
    response_body = models.TextField()
    task = models.ForeignKey(Task, null=True, on_delete=models.CASCADE)
    created_at = models.DateTimeField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["owner", "scope", "key"], name="idempotency_owner_scope_key")]


class MessageKind(models.TextChoices):
    START = "start"
    CANCEL = "cancel"
    QUERY = "query"
    INTEGRATE = "integrate"  # G7: merge or discard a worktree task's branch
    MESSAGE = "message"  # C2: a message for a live conversation's agent
    INTERRUPT = "interrupt"  # C4: stop the conversation's current turn
    END = "end"  # C5: close the agent's input, let it finish
    SESSION_MESSAGE = "session_message"  # T2: an owner's message for a terminal session on the machine
    SESSION_INTERRUPT = "session_interrupt"  # T5: stop a terminal session's current turn


class IntegrationAction(models.TextChoices):
    MERGE = "merge"
    DISCARD = "discard"


class IntegrationOutcome(models.TextChoices):
    """What the worker reports (G7): ``merged`` (with the commit), ``discarded``,
    ``conflict`` and ``base_dirty`` (with the paths; nothing changed), ``base_missing``
    (the base branch was deleted meanwhile) and ``failed`` (git refused; ``detail``)."""

    MERGED = "merged"
    DISCARDED = "discarded"
    CONFLICT = "conflict"
    BASE_DIRTY = "base_dirty"
    BASE_MISSING = "base_missing"
    FAILED = "failed"


class Integration(models.Model):
    """The owner's one decision on a final worktree task's branch (G7): merge or discard,
    who and when; the outcome arrives later as an ``integrated`` receipt. One per task,
    held by the database (the compare-and-set of the decision is this row's insert)."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    task = models.OneToOneField(Task, on_delete=models.CASCADE, related_name="integration")
    action = models.CharField(max_length=10, choices=IntegrationAction.choices)
    decided_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+")
    decided_at = models.DateTimeField()
    outcome = models.CharField(max_length=20, choices=IntegrationOutcome.choices, blank=True)  # "" until reported
    commit = models.CharField(max_length=64, blank=True)
    paths = models.JSONField(default=list, blank=True)
    detail = models.CharField(max_length=500, blank=True)
    reported_at = models.DateTimeField(null=True, blank=True)


class OutboxMessage(models.Model):
    """A message for a machine, written in the transaction of the change it announces (W2)."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    machine = models.ForeignKey(Machine, on_delete=models.CASCADE, related_name="outbox")
    # None for the session kinds (T2, T5): they belong to a session, not to a task.
    operation = models.ForeignKey(Operation, null=True, on_delete=models.CASCADE, related_name="messages")
    kind = models.CharField(max_length=20, choices=MessageKind.choices)
    payload = models.JSONField()
    created_at = models.DateTimeField()
    # Delivered again once visible_at passes without an ack.
    visible_at = models.DateTimeField()
    deliveries = models.PositiveIntegerField(default=0)
    acked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["created_at", "id"]
        indexes = [
            # messages_take (the worker's long-poll): unacked messages of one machine.
            models.Index(fields=["machine", "visible_at"], condition=Q(acked_at__isnull=True), name="outbox_pending"),
        ]


class ConversationMessageState(models.TextChoices):
    """C3: ``sent`` (accepted by the service), ``delivered`` (written to the agent),
    ``answered`` (its turn ended), ``undelivered`` (the task ended first); C10:
    ``withdrawn`` (taken back by its owner before the worker claimed it); C9: ``consumed``
    (the agent showed it took the message into a turn: ``turn_seq`` says whose; a message
    that opened a turn of its own goes on to ``answered`` when that turn ends)."""

    SENT = "sent"
    DELIVERED = "delivered"
    CONSUMED = "consumed"
    ANSWERED = "answered"
    UNDELIVERED = "undelivered"
    WITHDRAWN = "withdrawn"


class MessageDelivery(models.TextChoices):
    """C9: how a message joins the conversation."""

    QUEUE = "queue", "queue"
    STEER = "steer", "steer"


class ConversationMessage(models.Model):
    """One message of the owner into a conversation task (C2, C3): numbered per task in
    acceptance order (``seq`` from 1; the task's prompt is the conversation's message 0).
    Its state only moves forward (``conversation.message_receipt_apply``). In a ``resume``
    conversation each message is carried by a follow-up task (``carrier``, G6)."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="messages")
    seq = models.PositiveIntegerField()
    text = models.TextField()
    state = models.CharField(max_length=12, choices=ConversationMessageState.choices,
                             default=ConversationMessageState.SENT)
    carrier = models.ForeignKey(Task, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField()
    delivered_at = models.DateTimeField(null=True, blank=True)
    answered_at = models.DateTimeField(null=True, blank=True)
    # C10: when the worker claimed the message's delivery (``sent`` still; withdraw is a
    # compare-and-set against this claim: ``conversation.message_withdraw``).
    claimed_at = models.DateTimeField(null=True, blank=True)
    # C9: ``queue`` (its own turn after the current one) or ``steer`` (into the running turn).
    delivery = models.CharField(max_length=8, choices=MessageDelivery.choices, default=MessageDelivery.QUEUE)
    # C9: when the agent showed it took the message, and the ``seq`` of the message whose
    # turn took it (its own ``seq`` when it opened a turn; another's when it joined that one).
    consumed_at = models.DateTimeField(null=True, blank=True)
    turn_seq = models.PositiveIntegerField(null=True, blank=True)
    version = models.PositiveBigIntegerField(default=1)

    class Meta:
        ordering = ["task", "seq"]
        constraints = [models.UniqueConstraint(fields=["task", "seq"], name="conversation_message_task_seq")]


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
