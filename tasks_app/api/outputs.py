"""OpenAPI descriptions of the task API's answers (H): DRF serializers used only by
``extend_schema``, never to render. The bodies themselves come from the wire-shape
functions of ``tasks_app/shapes.py`` (``task_dict`` and friends); ``tests/test_api_schema.py`` checks that
real answers carry exactly the fields declared here."""
from rest_framework import serializers

from tasks_app.models import TaskState


class SurvivorOut(serializers.Serializer):
    """A process left after the stop (L8), as the worker named it."""

    pid = serializers.IntegerField()
    process_start_time = serializers.FloatField(allow_null=True, help_text="seconds since the epoch")
    name = serializers.CharField(required=False)
    cmdline = serializers.CharField(required=False, help_text="at most 200 characters")


class AgentResultOut(serializers.Serializer):
    """G3: the agent's own verdict."""

    is_error = serializers.BooleanField()
    subtype = serializers.CharField()
    summary = serializers.CharField(help_text="at most 4 KiB")


class UsageOut(serializers.Serializer):
    """G3: what the agent reported using; each null where the CLI does not say."""

    turns = serializers.IntegerField(allow_null=True)
    tool_calls = serializers.IntegerField(allow_null=True)
    input_tokens = serializers.IntegerField(allow_null=True, help_text="every input token read, cached or not")
    output_tokens = serializers.IntegerField(allow_null=True)
    cost_usd = serializers.FloatField(allow_null=True)


class ProgressOut(serializers.Serializer):
    """G4: the latest live progress of a running task."""

    seq = serializers.IntegerField()
    at = serializers.DateTimeField()
    last_message = serializers.CharField(allow_null=True)
    output_tail = serializers.CharField()
    usage = UsageOut(allow_null=True)


class GitEvidenceOut(serializers.Serializer):
    """G5: what changed in the folder's git work tree since the task started."""

    start_head = serializers.CharField(allow_null=True)
    end_head = serializers.CharField(allow_null=True)
    commits = serializers.IntegerField(allow_null=True)
    subjects = serializers.ListField(child=serializers.CharField(), help_text="up to 20, newest first")
    files_changed = serializers.IntegerField(allow_null=True)
    insertions = serializers.IntegerField(allow_null=True)
    deletions = serializers.IntegerField(allow_null=True)
    dirty = serializers.ListField(child=serializers.CharField(), help_text="up to 50 paths")
    dirty_count = serializers.IntegerField(allow_null=True)
    start_dirty = serializers.IntegerField(allow_null=True)


class EvidenceOut(serializers.Serializer):
    git = GitEvidenceOut(required=False)


class TaskOut(serializers.Serializer):
    """A task as ``GET /api/tasks/`` lists it and ``task`` board events carry it (H, B1)."""

    id = serializers.UUIDField()
    state = serializers.ChoiceField(TaskState.choices)
    state_reason = serializers.CharField()
    machine = serializers.UUIDField()
    folder = serializers.CharField()
    agent = serializers.CharField()
    prompt = serializers.CharField()
    session = serializers.UUIDField(allow_null=True)
    deep_research = serializers.BooleanField()
    max_runtime_s = serializers.IntegerField(help_text="seconds")
    exclusive = serializers.BooleanField()
    created_at = serializers.DateTimeField()
    updated_at = serializers.DateTimeField()
    final_at = serializers.DateTimeField(allow_null=True)
    cancel_requested_at = serializers.DateTimeField(allow_null=True)
    reserved_s = serializers.FloatField(help_text="budget seconds reserved")
    charged_s = serializers.FloatField(allow_null=True, help_text="budget seconds charged")
    pid = serializers.IntegerField(allow_null=True)
    exit_code = serializers.IntegerField(allow_null=True)
    signal = serializers.IntegerField(allow_null=True)
    stop_reason = serializers.CharField()
    runtime_s = serializers.FloatField(allow_null=True)
    slept_s = serializers.FloatField(allow_null=True)
    survivors = SurvivorOut(many=True)
    output_tail = serializers.CharField()
    holds_lock = serializers.BooleanField(help_text="whether it holds its folder lock (A8)")
    agent_session_id = serializers.CharField(allow_null=True, help_text="the agent's own session id (G2, G6)")
    agent_result = AgentResultOut(allow_null=True)
    usage = UsageOut(allow_null=True)
    progress = ProgressOut(allow_null=True)
    evidence = EvidenceOut()
    continue_task = serializers.UUIDField(allow_null=True, help_text="the task this follow-up continues (G6)")
    version = serializers.IntegerField()


class LeaseSummaryOut(serializers.Serializer):
    id = serializers.UUIDField()
    granted_at = serializers.DateTimeField()
    expires_at = serializers.DateTimeField()
    renewals = serializers.IntegerField()
    last_renewed_at = serializers.DateTimeField(allow_null=True)
    refused_reason = serializers.CharField()
    ended_at = serializers.DateTimeField(allow_null=True)
    end_reason = serializers.CharField()


class TaskEventOut(serializers.Serializer):
    old_state = serializers.CharField()
    new_state = serializers.CharField()
    reason = serializers.CharField()
    actor = serializers.CharField()
    at = serializers.DateTimeField()


class ReceiptRecordOut(serializers.Serializer):
    event_id = serializers.CharField()
    kind = serializers.CharField()
    generation = serializers.IntegerField()
    body = serializers.DictField(help_text="the receipt as the worker sent it")
    answer = serializers.CharField(help_text="the exact answer body the service returned (R1)")
    received_at = serializers.DateTimeField()


class TaskDetailOut(TaskOut):
    """``GET /api/tasks/{id}/``: the task with its lease, events and last 50 receipts."""

    lease = LeaseSummaryOut(allow_null=True)
    events = TaskEventOut(many=True)
    receipts = ReceiptRecordOut(many=True)


class ProfileOut(serializers.Serializer):
    """A worker profile as the machine reported it (B10, G1)."""

    name = serializers.CharField()
    preset = serializers.CharField(allow_null=True)


class ProfilesOut(serializers.Serializer):
    profiles = ProfileOut(many=True)


class MachineOut(serializers.Serializer):
    """A machine as ``GET /api/machines/`` lists it and ``machine`` events carry it (B7)."""

    id = serializers.UUIDField()
    name = serializers.CharField()
    generation = serializers.IntegerField()
    paired = serializers.BooleanField()
    last_heard_at = serializers.DateTimeField(allow_null=True)
    offline = serializers.BooleanField(help_text="not heard from within RUNSTEAD_MACHINE_OFFLINE_S (B7)")
    offline_at = serializers.DateTimeField(
        allow_null=True, help_text="when it turns offline unless heard from before; null: never heard (B7)"
    )
    profiles = ProfileOut(many=True, help_text="as last reported by PUT /api/worker/profiles/ (B10)")
    version = serializers.IntegerField()


class GrantOut(serializers.Serializer):
    id = serializers.UUIDField()
    machine = serializers.UUIDField()
    path = serializers.CharField()
    created_at = serializers.DateTimeField()
    revoked_at = serializers.DateTimeField(allow_null=True)


class BoardTaskOut(TaskOut):
    """A task on the board snapshot: as in ``task`` events, plus when its run began."""

    started_at = serializers.DateTimeField(allow_null=True, help_text="when its lease was granted")


class BudgetOut(serializers.Serializer):
    limit_s = serializers.FloatField()
    reserved_s = serializers.FloatField()
    spent_s = serializers.FloatField()


class TokenOut(serializers.Serializer):
    token = serializers.CharField()


class PairingCodeOut(serializers.Serializer):
    code = serializers.CharField()
    expires_at = serializers.DateTimeField()


class WorkerPairOut(serializers.Serializer):
    machine_id = serializers.UUIDField()
    token = serializers.CharField(help_text="the machine token, shown once")
    generation = serializers.IntegerField()
    name = serializers.CharField()


class MessageOut(serializers.Serializer):
    id = serializers.UUIDField()
    kind = serializers.ChoiceField(["start", "cancel", "query"])
    operation_id = serializers.UUIDField()
    payload = serializers.DictField(help_text="free-form per kind, see H: start, cancel, query")


class MessagesOut(serializers.Serializer):
    messages = MessageOut(many=True)


class AckOut(serializers.Serializer):
    acked = serializers.BooleanField()


class LeaseOut(serializers.Serializer):
    """A lease grant or renewal answer (L1, L2); all durations in seconds."""

    lease_id = serializers.UUIDField()
    expires_at = serializers.DateTimeField()
    duration_s = serializers.FloatField()
    renew_every_s = serializers.FloatField()
    margin_s = serializers.FloatField()
    kill_grace_s = serializers.FloatField()


class ReceiptAnswerOut(serializers.Serializer):
    """R3: ``{"outcome": "applied"}`` or ``{"outcome": "not_applied", "reason"}``."""

    outcome = serializers.ChoiceField(["applied", "not_applied"])
    reason = serializers.CharField(required=False)
