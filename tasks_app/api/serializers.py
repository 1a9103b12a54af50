"""Wire shapes of the task API (SPEC H): input validation (every body and query string
through ``config.strict``, K3) and output rendering."""
from django.conf import settings
from rest_framework import serializers

from config import clock
from config.pagination import PageQuery
from config.strict import QueryFloatField, StrictQuerySerializer, StrictSerializer
from tasks_app.models import Grant, Machine, Task, TaskState
from tasks_app.services.acceptance import folder_problem
from tasks_app.services.messages import MAX_WAIT_S

PROMPT_MAX_BYTES = 64 * 1024
INT32_MAX = 2**31 - 1  # what the database's integer columns hold
RECEIPT_KINDS = ("starting", "running", "final", "unknown", "report")
# J1: why the process ended, as the worker reports it.
STOP_REASONS = ("exit", "cancel", "deadline", "renewal_refused", "max_runtime", "worker_shutdown", "worker_restart", "refused")


def _valid_folder(value: str) -> str:
    problem = folder_problem(value)
    if problem:
        raise serializers.ValidationError(problem)
    return value


class TaskCreateSerializer(StrictSerializer):
    machine = serializers.UUIDField()
    folder = serializers.CharField(max_length=4096, trim_whitespace=False)
    agent = serializers.RegexField(r"^[A-Za-z0-9_.-]{1,100}$")
    prompt = serializers.CharField(trim_whitespace=False, allow_blank=False)
    session = serializers.UUIDField(required=False, allow_null=True)
    deep_research = serializers.BooleanField(default=False)
    max_runtime_s = serializers.IntegerField(default=1800, min_value=1, max_value=7 * 86400)
    exclusive = serializers.BooleanField(default=True)

    def validate_prompt(self, value):
        if "\x00" in value:
            raise serializers.ValidationError("must not contain NUL")
        if len(value.encode()) > PROMPT_MAX_BYTES:
            raise serializers.ValidationError(f"must be at most {PROMPT_MAX_BYTES} bytes")
        return value

    def validate_folder(self, value):
        return _valid_folder(value)


class GrantCreateSerializer(StrictSerializer):
    machine = serializers.UUIDField()
    path = serializers.CharField(max_length=4096)

    def validate_path(self, value):
        return _valid_folder(value)


class PairingCodeSerializer(StrictSerializer):
    name = serializers.CharField(max_length=200, required=False)
    machine = serializers.UUIDField(required=False)

    def validate(self, attrs):
        if bool(attrs.get("name")) == bool(attrs.get("machine")):
            raise serializers.ValidationError({"non_field_errors": ["give either name or machine"]})
        return attrs


class PairSerializer(StrictSerializer):
    code = serializers.CharField(max_length=64)
    name = serializers.CharField(max_length=200, required=False, allow_blank=True)


class TaskListQuery(PageQuery):
    """``GET /api/tasks/`` filters (B11), besides ``cursor`` and ``limit``."""

    state = serializers.ChoiceField(TaskState.choices, required=False)
    machine = serializers.UUIDField(required=False)
    session = serializers.UUIDField(required=False)


class MessagesQuery(StrictQuerySerializer):
    """``GET /api/worker/messages/?wait=S``: seconds to hold the poll open, 0-25 (W2)."""

    wait = QueryFloatField(required=False, default=0, min_value=0, max_value=MAX_WAIT_S)


class LeaseGrantSerializer(StrictSerializer):
    operation_id = serializers.UUIDField()


class LeaseRenewSerializer(StrictSerializer):
    output_tail = serializers.CharField(required=False, allow_blank=True, trim_whitespace=False, max_length=64 * 1024)


class ReceiptSerializer(StrictSerializer):
    event_id = serializers.CharField(min_length=1, max_length=100)
    generation = serializers.IntegerField(min_value=0, max_value=INT32_MAX)
    operation_id = serializers.UUIDField()
    kind = serializers.ChoiceField(RECEIPT_KINDS)
    slept_s = serializers.FloatField(required=False, allow_null=True, min_value=0)
    facts = serializers.DictField(required=False, default=dict)

    def validate(self, attrs):
        facts = attrs["facts"]
        kind = attrs["kind"]
        if kind == "final":
            _validate_final_facts(facts)
        if kind == "running":
            _validate_running_facts(facts)
        if kind == "report":
            record = facts.get("record", "missing")
            if record == "missing" or not (record is None or isinstance(record, dict)):
                raise serializers.ValidationError({"facts": ["report needs record: null or an object"]})
            if record is not None and record.get("final") is not None:
                if not isinstance(record["final"], dict):
                    raise serializers.ValidationError({"facts": ["record.final must be null or an object"]})
                _validate_final_facts(record["final"])
        attrs["operation_id"] = str(attrs["operation_id"])
        return attrs


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)




def _is_pid(value) -> bool:
    return _is_int(value) and 0 < value <= INT32_MAX


def _is_int32(value) -> bool:
    return _is_int(value) and -INT32_MAX - 1 <= value <= INT32_MAX


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _validate_running_facts(facts: dict) -> None:
    """``running`` facts: pid and pgid positive integers, process_start_time a number."""
    if not _is_pid(facts.get("pid")):
        raise serializers.ValidationError({"facts": ["running needs a positive integer pid"]})
    if facts.get("pgid") is not None and not _is_pid(facts["pgid"]):
        raise serializers.ValidationError({"facts": ["pgid must be a positive integer"]})
    if facts.get("process_start_time") is not None and not _is_number(facts["process_start_time"]):
        raise serializers.ValidationError({"facts": ["process_start_time must be a number"]})


def _validate_final_facts(facts: dict) -> None:
    """J1 shape of final facts (in a ``final`` receipt or a report's ``record.final``);
    a malformed one is refused with 400 (R3) rather than judged."""
    started = facts.get("process_started")
    if not (isinstance(started, bool) or started == "unknown"):
        raise serializers.ValidationError({"facts": ["process_started must be true, false or \"unknown\""]})
    for name in ("exit_code", "signal"):
        if facts.get(name) is not None and not _is_int32(facts[name]):
            raise serializers.ValidationError({"facts": [f"{name} must be a 32-bit integer or null"]})
    runtime = facts.get("runtime_s")
    if runtime is not None and (isinstance(runtime, bool) or not isinstance(runtime, (int, float)) or runtime < 0):
        raise serializers.ValidationError({"facts": ["runtime_s must be a non-negative number"]})
    if not (facts.get("ended_within_lease") is None or isinstance(facts["ended_within_lease"], bool)):
        raise serializers.ValidationError({"facts": ["ended_within_lease must be true, false or null"]})
    if facts.get("stop_reason") not in STOP_REASONS:
        raise serializers.ValidationError({"facts": [f"stop_reason must be one of {', '.join(STOP_REASONS)}"]})
    survivors = facts.get("survivors", [])
    if not isinstance(survivors, list) or not all(isinstance(s, dict) and _is_pid(s.get("pid")) for s in survivors):
        raise serializers.ValidationError({"facts": ["survivors must be a list of objects with a pid"]})
    if facts.get("output_tail") is not None and not isinstance(facts["output_tail"], str):
        raise serializers.ValidationError({"facts": ["output_tail must be a string"]})


def _iso(value):
    return value.isoformat() if value else None


def serialize_machine(machine: Machine, *, now=None) -> dict:
    """Machine shape of GET /api/machines/ and of ``machine`` board events (B7)."""
    now = now or clock.now()
    offline = machine.last_heard_at is None or (now - machine.last_heard_at).total_seconds() > settings.RUNSTEAD_MACHINE_OFFLINE_S
    return {
        "id": str(machine.id),
        "name": machine.name,
        "generation": machine.generation,
        "paired": machine.paired,
        "last_heard_at": _iso(machine.last_heard_at),
        "offline": offline,
        "profiles": machine.profiles,
        "version": machine.version,
    }


def serialize_task(task: Task) -> dict:
    """Task shape of the API and of ``task`` board events (H, B1)."""
    return {
        "id": str(task.id),
        "state": task.state,
        "state_reason": task.state_reason,
        "machine": str(task.machine_id),
        "folder": task.folder,
        "agent": task.agent,
        "prompt": task.prompt,
        "session": str(task.session_id) if task.session_id else None,
        "deep_research": task.deep_research,
        "max_runtime_s": task.max_runtime_s,
        "exclusive": task.exclusive,
        "created_at": _iso(task.created_at),
        "updated_at": _iso(task.updated_at),
        "final_at": _iso(task.final_at),
        "cancel_requested_at": _iso(task.cancel_requested_at),
        "reserved_s": task.reserved_s,
        "charged_s": task.charged_s,
        "pid": task.pid,
        "exit_code": task.exit_code,
        "signal": task.signal,
        "stop_reason": task.stop_reason,
        "runtime_s": task.runtime_s,
        "slept_s": task.slept_s,
        "survivors": task.survivors,
        "output_tail": task.output_tail,
        "holds_lock": task.holds_lock,
        "version": task.version,
    }


def serialize_task_detail(task: Task) -> dict:
    """GET /api/tasks/{id}/: the task with its events, lease and last 50 receipts."""
    lease = task.leases.first()
    return {
        **serialize_task(task),
        "lease": None
        if lease is None
        else {
            "id": str(lease.id),
            "granted_at": _iso(lease.granted_at),
            "expires_at": _iso(lease.expires_at),
            "renewals": lease.renewals,
            "last_renewed_at": _iso(lease.last_renewed_at),
            "refused_reason": lease.refused_reason,
            "ended_at": _iso(lease.ended_at),
            "end_reason": lease.end_reason,
        },
        "events": [
            {"old_state": e.old_state, "new_state": e.new_state, "reason": e.reason, "actor": e.actor, "at": _iso(e.at)}
            for e in task.events.all()
        ],
        "receipts": [
            {"event_id": r.event_id, "kind": r.kind, "generation": r.generation, "body": r.body,
             "answer": r.response_body, "received_at": _iso(r.received_at)}
            for r in task.receipts.all()[:50]
        ],
    }


def serialize_grant(grant: Grant) -> dict:
    return {
        "id": str(grant.id),
        "machine": str(grant.machine_id),
        "path": grant.path,
        "created_at": _iso(grant.created_at),
        "revoked_at": _iso(grant.revoked_at),
    }
