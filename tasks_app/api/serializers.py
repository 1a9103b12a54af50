"""Input validation of the task API (SPEC H, K3): every body and query string through
``core.strict``. What the API answers is rendered, and described for OpenAPI, by the
shapes of ``tasks_app/shapes.py``."""
import uuid

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from core.pagination import PageQuery
from core.strict import QueryFloatField, StrictQuerySerializer, StrictSerializer, valid_message_text
from core.text import control_character
from tasks_app.agent_facts import FactsError, clean_agent_facts
from tasks_app.models import IntegrationAction, IntegrationOutcome, MessageDelivery, TaskState
from machine.protocol import DEFAULT_MAX_RUNTIME_S, LONG_POLL_MAX_S
from machine.protocol.shapes import RECEIPT_KINDS, STOP_REASONS, SYNC_ITEMS_MAX
from tasks_app.services.folders import folder_problem
from tasks_app.services.machine_choice import PoolName
from tasks_app.services.pools import POOL_MACHINES_MAX, POOL_NAME, pool_name_problem

PROMPT_MAX_BYTES = 64 * 1024
SEARCH_MAX_CHARS = 200  # B11: the longest prompt search (?q=)
INT32_MAX = 2**31 - 1  # what the database's integer columns hold


def _valid_folder(value: str) -> str:
    problem = folder_problem(value)
    if problem:
        raise serializers.ValidationError(problem)
    return value


@extend_schema_field({"oneOf": [{"type": "string", "format": "uuid"}, {"type": "string", "enum": ["any"]},
                                 {"type": "string", "pattern": POOL_NAME.pattern}],
                      "description": 'a machine id; "any": acceptance picks one of your machines; or the name of '
                                     'one of your pools (/api/pools/): acceptance picks one of its machines (C8)'})
class MachineChoiceField(serializers.Field):
    """C8: a machine id (a ``uuid.UUID``), ``"any"`` (acceptance picks the machine), or a
    pool name (a ``PoolName``; acceptance picks among the pool's machines, 400
    ``pool_unknown`` when the owner has no such pool). Any other value (``"ANY"``, a
    number, null) is a bad body (400 ``invalid``)."""

    default_error_messages = {"invalid": 'must be a machine id, "any" or the name of one of your pools'}

    def to_internal_value(self, data):
        if data == "any":
            return "any"
        if isinstance(data, str):
            try:
                return uuid.UUID(data)
            except ValueError:
                pass
            if pool_name_problem(data) is None:
                return PoolName(data)
        self.fail("invalid")

    def to_representation(self, value):
        return str(value)


class TaskCreateSerializer(StrictSerializer):
    machine = MachineChoiceField()  # C8: or "any", or a pool name
    folder = serializers.CharField(max_length=4096, trim_whitespace=False)
    agent = serializers.RegexField(r"^[A-Za-z0-9_.-]{1,100}$")
    prompt = serializers.CharField(trim_whitespace=False, allow_blank=False)
    session = serializers.UUIDField(required=False, allow_null=True)
    deep_research = serializers.BooleanField(default=False)
    max_runtime_s = serializers.IntegerField(default=DEFAULT_MAX_RUNTIME_S, min_value=1, max_value=7 * 86400)
    exclusive = serializers.BooleanField(default=True)
    continue_task = serializers.UUIDField(required=False)  # G6
    isolation = serializers.ChoiceField(["worktree", "none"], required=False)  # G7; absent: the profile's
    mode = serializers.ChoiceField(["task", "conversation"], required=False)  # C1; absent: "task"

    def validate_prompt(self, value):
        if "\x00" in value:
            raise serializers.ValidationError("must not contain NUL")
        if len(value.encode()) > PROMPT_MAX_BYTES:
            raise serializers.ValidationError(f"must be at most {PROMPT_MAX_BYTES} bytes")
        return value

    def validate_folder(self, value):
        return _valid_folder(value)

    def validate(self, attrs):
        # C7: a conversation's prompt is its message 0, under the messages' rule.
        if attrs.get("mode") == "conversation" and (found := control_character(attrs["prompt"])) is not None:
            raise serializers.ValidationError(
                {"prompt": [f"a conversation's prompt must not contain control characters (found {found})"]})
        return attrs


class IntegrateSerializer(StrictSerializer):
    """``POST /api/tasks/{id}/integrate/`` (G7)."""

    action = serializers.ChoiceField(IntegrationAction.choices)


class MessageCreateSerializer(StrictSerializer):
    """``POST /api/tasks/{id}/messages/`` (C2, C7, C9): ``{text, delivery?}``, text 1 to
    ``RUNSTEAD_MESSAGE_MAX_BYTES`` bytes of UTF-8, not only white space, no control
    character but newline and tab (``core.text``: C0, DEL, C1, the bidi controls; as T2)."""

    text = serializers.CharField(trim_whitespace=False, allow_blank=True)
    delivery = serializers.ChoiceField(
        MessageDelivery.choices, required=False, default=MessageDelivery.QUEUE,
        help_text='C9: "queue" (default: its own turn after the current one) or "steer" (into the running turn '
                  'as soon as the agent can take it; 409 steer_unsupported where the CLI cannot)')

    def validate_text(self, value):
        return valid_message_text(value)


class PoolNameField(serializers.CharField):
    """C8: a pool name (``services.pools.pool_name_problem``)."""

    def __init__(self, **kwargs):
        super().__init__(max_length=64, trim_whitespace=False, **kwargs)

    def to_internal_value(self, data):
        value = super().to_internal_value(data)
        problem = pool_name_problem(value)
        if problem:
            raise serializers.ValidationError(problem)
        return value


class PoolCreateSerializer(StrictSerializer):
    """``POST /api/pools/`` (C8): ``{"name", "machines"?: [machine id]}`` (distinct ids,
    at most ``POOL_MACHINES_MAX``; default none)."""

    name = PoolNameField()
    machines = serializers.ListField(child=serializers.UUIDField(), max_length=POOL_MACHINES_MAX, default=list)

    def validate_machines(self, value):
        if len(set(value)) != len(value):
            raise serializers.ValidationError("a machine is listed twice")
        return value


class PoolUpdateSerializer(PoolCreateSerializer):
    """``PATCH /api/pools/{id}/`` (C8): ``name`` and/or ``machines`` (the new set); the
    fields left out stay; an empty body changes nothing but is refused as bad input."""

    name = PoolNameField(required=False)
    machines = serializers.ListField(child=serializers.UUIDField(), max_length=POOL_MACHINES_MAX, required=False)

    def validate(self, attrs):
        if not attrs:
            raise serializers.ValidationError({"non_field_errors": ["give name or machines"]})
        return attrs


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
    q = serializers.CharField(
        required=False, min_length=1, max_length=SEARCH_MAX_CHARS, trim_whitespace=False,
        help_text=f"B11: tasks whose prompt contains this text (case-insensitive), 1-{SEARCH_MAX_CHARS} characters",
    )

    def validate_q(self, value):
        if "\x00" in value or not value.strip():
            raise serializers.ValidationError("must be text to search for")
        return value


class MessagesQuery(StrictQuerySerializer):
    """``GET /api/worker/messages/?wait=S``: seconds to hold the poll open, 0 to ``LONG_POLL_MAX_S`` (25) (W2)."""

    wait = QueryFloatField(required=False, default=0, min_value=0, max_value=LONG_POLL_MAX_S)


class LeaseGrantSerializer(StrictSerializer):
    operation_id = serializers.UUIDField()
    approval_credential = serializers.BooleanField(
        required=False, default=False,
        help_text="Q5: the run asks its owner through approvals; the answer carries a fresh per-task credential")


class LeaseRenewSerializer(StrictSerializer):
    output_tail = serializers.CharField(required=False, allow_blank=True, trim_whitespace=False, max_length=64 * 1024)


class ReceiptSerializer(StrictSerializer):
    """``POST /api/worker/receipts/``: a ``machine.protocol.shapes.ReceiptBody`` (the same
    fields, the same required ones: ``tests/test_protocol.py`` compares them), its facts
    validated per kind (J1, U1, G7, C3)."""

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
        if kind == "integrated":
            _validate_integrated_facts(facts)
        if kind == "message":
            _validate_message_facts(facts)
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


def _validate_message_facts(facts: dict) -> None:
    """C3 ``message`` facts: ``{message_id, state}``, state delivered, answered or undelivered
    (or ``claimed``, the worker's claim before it writes, C10; or ``consumed`` with
    ``turn_seq``, a seq from 0, C9)."""
    if facts.get("state") == "consumed":
        if set(facts) != {"message_id", "state", "turn_seq"}:
            raise serializers.ValidationError({"facts": ["consumed message facts are message_id, state and turn_seq"]})
        if type(facts["turn_seq"]) is not int or not 0 <= facts["turn_seq"] < 2 ** 31:
            raise serializers.ValidationError({"facts": ["turn_seq must be a seq (an integer from 0)"]})
    elif set(facts) != {"message_id", "state"}:
        raise serializers.ValidationError({"facts": ["message facts are message_id and state"]})
    try:
        if not isinstance(facts["message_id"], str):
            raise ValueError
        facts["message_id"] = str(uuid.UUID(facts["message_id"]))
    except ValueError:
        raise serializers.ValidationError({"facts": ["message_id must be a UUID"]})
    if facts["state"] not in ("claimed", "delivered", "consumed", "answered", "undelivered"):
        raise serializers.ValidationError(
            {"facts": ["state must be claimed, delivered, consumed, answered or undelivered"]})


def _validate_integrated_facts(facts: dict) -> None:
    """G7 ``integrated`` facts: ``{integration_id, outcome, commit?, paths?, detail?}``."""
    if set(facts) - {"integration_id", "outcome", "commit", "paths", "detail"}:
        raise serializers.ValidationError({"facts": ["integrated facts are integration_id, outcome, commit, paths, detail"]})
    try:
        if not isinstance(facts.get("integration_id"), str):
            raise ValueError
        facts["integration_id"] = str(uuid.UUID(facts["integration_id"]))
    except ValueError:
        raise serializers.ValidationError({"facts": ["integration_id must be a UUID"]})
    if facts.get("outcome") not in IntegrationOutcome.values:
        raise serializers.ValidationError({"facts": [f"outcome must be one of {', '.join(IntegrationOutcome.values)}"]})
    commit = facts.get("commit")
    if commit is not None and not (isinstance(commit, str) and 4 <= len(commit) <= 64
                                   and all(c in "0123456789abcdef" for c in commit)):
        raise serializers.ValidationError({"facts": ["commit must be a commit id or null"]})
    paths = facts.get("paths", [])
    if not isinstance(paths, list) or len(paths) > 1000 or not all(isinstance(p, str) and len(p) <= 1024 for p in paths):
        raise serializers.ValidationError({"facts": ["paths must be a list of at most 1000 paths"]})
    if not isinstance(facts.get("detail", ""), str) or len(facts.get("detail", "")) > 2000:
        raise serializers.ValidationError({"facts": ["detail must be a string of at most 2000 characters"]})


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
    try:
        clean_agent_facts(facts)  # G1-G5 keys
    except FactsError as exc:
        raise serializers.ValidationError({"facts": [str(exc)]})


class SyncRenewalSerializer(StrictSerializer):
    """One renewal of a sync: ``machine.protocol.shapes.SyncRenewal``."""

    lease_id = serializers.UUIDField()
    output_tail = serializers.CharField(required=False, allow_blank=True, trim_whitespace=False, max_length=64 * 1024)


class SyncSerializer(StrictSerializer):
    """``POST /api/worker/sync/``: a ``machine.protocol.shapes.SyncBody``. Every item is
    validated before anything is applied: one malformed renewal or receipt refuses the
    whole request (400, K3), nothing applied."""

    renew = SyncRenewalSerializer(many=True, required=False, max_length=SYNC_ITEMS_MAX)
    receipts = ReceiptSerializer(many=True, required=False, max_length=SYNC_ITEMS_MAX)

    def validate(self, attrs):
        if not attrs.get("renew") and not attrs.get("receipts"):
            raise serializers.ValidationError({"non_field_errors": ["give leases to renew or receipts"]})
        return attrs
