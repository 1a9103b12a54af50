"""Approvals API (SPEC Q1-Q4, Q7, H): views parse and authorise, ``sessions_app.approvals``
decides, ``sessions_app.shapes.approval_dict`` renders.

Who may call what (Q7, K2):

- ``POST /api/approvals/``, ``GET /api/approvals/``, ``GET /api/approvals/{id}/``: the
  owner (token or browser session), or a task's approval credential
  (``Authorization: Task <credential>``), which reaches only its own task's approvals
  (another task's id answers 404, a session approval 403);
- ``POST /api/approvals/{id}/decision/`` and ``.../terminal/``: the owner only; a task
  credential or a machine token gets 403 ``permission_denied`` and changes nothing.

Another owner's ids answer 404 everywhere. Input is strict (K3); ``tool_input`` is never
logged (Q7): no view logs bodies, and refusals name the field, never its value.
"""
import json
import uuid

from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers, status
from rest_framework.generics import GenericAPIView
from rest_framework.response import Response
from rest_framework.views import APIView

from core import clock
from core.actors import actor_owner
from core.errors import ApplicationError
from core.idempotency import body_digest, parse_idempotency_key, respond_once
from core.longpoll import LongPoll
from core.pagination import PageQuery
from core.schema import errors, shape
from core.strict import EmptyBody, NoQuery, QueryFloatField, StrictQuerySerializer, StrictSerializer, valid_body, valid_query
from core.throttling import SettingsRateThrottle
from sessions_app import approvals
from sessions_app.api.serializers import SESSION_AGENTS, absolute_or_blank
from sessions_app.models import Approval, ApprovalScope, ApprovalState
from sessions_app.shapes import ApprovalShape, approval_dict
from tasks_app.auth import IsOwnerOrTaskCredential, owner_tokens, request_task_credential
from tasks_app.models import IdempotencyRecord
from machine.protocol import APPROVAL_INPUT_MAX_BYTES, APPROVAL_WAIT_MAX_S, json_bytes

KEY_RE = r"^[\x21-\x7e]{1,255}$"  # printable ASCII without spaces, as the hooks derive it
SUGGESTIONS_MAX_BYTES = 16 * 1024
MESSAGE_MAX = 2000


# --- input ------------------------------------------------------------------------------


def _without_nul(value):
    """K3: a NUL (U+0000) anywhere in a key or a string: 400, not PostgreSQL's refusal to
    store it in ``jsonb`` (a 500)."""
    if "\\u0000" in json.dumps(value):
        raise serializers.ValidationError("must not contain NUL (U+0000) in a key or a string")
    return value


class ApprovalCreateIn(StrictSerializer):
    """``POST /api/approvals/`` (Q1). Exactly one of ``session`` and ``task``; a task
    credential may only name its own task (or none: its task is meant)."""

    key = serializers.RegexField(KEY_RE, help_text="the asking hook's idempotency key (Q1), 1-255 printable ASCII")
    session = serializers.UUIDField(required=False, help_text="the RunStead session id (I2) of an interactive agent")
    task = serializers.UUIDField(required=False, help_text="the headless task that asks (Q5)")
    agent = serializers.ChoiceField([a for a in SESSION_AGENTS if a])
    tool_name = serializers.CharField(max_length=200)
    tool_input = serializers.DictField(help_text=f"the tool's input as the CLI gave it, at most {APPROVAL_INPUT_MAX_BYTES} "
                                                 "bytes of JSON; kept cut to 4 KiB")
    cwd = serializers.CharField(max_length=1024, required=False, allow_blank=True, default="",
                                validators=[absolute_or_blank], trim_whitespace=False)
    suggestions = serializers.ListField(child=serializers.DictField(), required=False, default=list, max_length=50,
                                        help_text="the CLI's permission_suggestions (for allow for this session)")

    def validate_tool_input(self, value):
        if json_bytes(value) > APPROVAL_INPUT_MAX_BYTES:
            raise serializers.ValidationError(f"over {APPROVAL_INPUT_MAX_BYTES} bytes as JSON")
        return _without_nul(value)

    def validate_suggestions(self, value):
        if json_bytes(value) > SUGGESTIONS_MAX_BYTES:
            raise serializers.ValidationError(f"over {SUGGESTIONS_MAX_BYTES} bytes as JSON")
        return _without_nul(value)

    def validate(self, data):
        credential = self.context.get("credential")
        if credential is not None:
            if "session" in data:
                raise ApplicationError("permission_denied", "a task credential asks only for its own task",
                                       status_code=403)
            if data.setdefault("task", credential.task.pk) != credential.task.pk:
                raise ApplicationError("not_found", "no such task", status_code=404)
        if ("session" in data) == ("task" in data):
            raise serializers.ValidationError({"session": "give exactly one of session and task"})
        return data


class ApprovalListQuery(PageQuery):
    """``GET /api/approvals/`` filters, besides ``cursor`` and ``limit`` (B11)."""

    state = serializers.ChoiceField(ApprovalState.choices, required=False)
    session = serializers.UUIDField(required=False)
    task = serializers.UUIDField(required=False)


class ApprovalWaitQuery(StrictQuerySerializer):
    """``GET /api/approvals/{id}/?wait=S``: hold the request while the approval is
    pending, 0 to 25 seconds (Q3)."""

    wait = QueryFloatField(required=False, default=0, min_value=0, max_value=APPROVAL_WAIT_MAX_S)


class DecisionIn(StrictSerializer):
    """``POST /api/approvals/{id}/decision/`` (Q2): ``allow`` (``scope`` ``once``, the
    default, or ``session``) or ``deny`` (with an optional ``message`` to the agent)."""

    behavior = serializers.ChoiceField(["allow", "deny"])
    message = serializers.CharField(max_length=MESSAGE_MAX, required=False, allow_blank=True, default="",
                                    trim_whitespace=False)
    scope = serializers.ChoiceField(ApprovalScope.choices, required=False)

    def validate(self, data):
        if data["behavior"] == "allow" and data["message"]:
            raise serializers.ValidationError({"message": "only with deny"})
        if data["behavior"] == "deny" and "scope" in data:
            raise serializers.ValidationError({"scope": "only with allow"})
        if data["behavior"] == "allow":
            data.setdefault("scope", ApprovalScope.ONCE)
        return data


# --- rate limit (K3, Q7) ----------------------------------------------------------------


class ApprovalCreateRate(SettingsRateThrottle):
    """Approvals created per session or task: ``RUNSTEAD_APPROVAL_RATE``."""

    scope = "approval"
    rate_setting = "RUNSTEAD_APPROVAL_RATE"

    def get_cache_key(self, request, view):
        credential = request_task_credential(request)
        data = request.data if isinstance(request.data, dict) else {}
        target = str(credential.task.pk) if credential else str(data.get("session") or data.get("task") or "")
        return f"runstead:rate:{self.scope}:{target[:64]}" if target else None


# --- views ------------------------------------------------------------------------------


def visible_approvals(request):
    """The approvals the caller may see: the owner's, or the credential's task's."""
    credential = request_task_credential(request)
    approvals_ = Approval.objects.filter(owner=request.user).select_related("session", "task")
    return approvals_.filter(task=credential.task) if credential else approvals_


class ApprovalListCreate(GenericAPIView):
    """GET: approvals, newest first (B11), filtered by ``state``, ``session``, ``task``.
    POST: ask (Q1): 201 with the new approval, 200 with the same row for a known key."""

    permission_classes = [IsOwnerOrTaskCredential]
    serializer_class = ApprovalCreateIn
    query_serializer_class = ApprovalListQuery

    def get_throttles(self):
        return [ApprovalCreateRate()] if self.request.method == "POST" else []

    @extend_schema(parameters=[ApprovalListQuery], responses={200: shape(ApprovalShape, many=True), **errors()})
    def get(self, request):
        params = valid_query(ApprovalListQuery, request)
        rows = visible_approvals(request)
        for name in ("state", "session", "task"):
            if name in params:
                rows = rows.filter(**{name: params[name]})
        page = self.paginate_queryset(rows)
        return self.get_paginated_response([approval_dict(a) for a in page])

    @extend_schema(request=ApprovalCreateIn, responses={201: shape(ApprovalShape), 200: shape(ApprovalShape), **errors(409, 422, 429)})
    def post(self, request):
        valid_query(NoQuery, request)
        data = valid_body(ApprovalCreateIn, request, credential=request_task_credential(request))
        ask = approvals.Ask(key=data["key"], session_id=data.get("session"), task_id=data.get("task"),
                            agent=data["agent"], tool_name=data["tool_name"], tool_input=data["tool_input"],
                            cwd=data["cwd"], suggestions=data["suggestions"])
        approval, created = approvals.approval_create(owner=request.user, ask=ask, now=clock.now())
        return Response(approval_dict(approval), status=status.HTTP_201_CREATED if created else status.HTTP_200_OK)


def _visible(request, approval_id) -> Approval:
    approval = visible_approvals(request).filter(pk=approval_id).first()
    if approval is None:
        raise ApplicationError("not_found", "no such approval", status_code=404)
    return approval


class OwnersApproval:
    """The approval long-poll's fast path authentication (``core.longpoll.QuickAuth``;
    issue 44: every waiting hook starts again every ~25 s): an owner's token
    (``tasks_app.auth.owner_tokens``, K1 as for the view) and the approval of the path,
    which must be that owner's (``approvals.approval_owners``; another owner's is left
    to the view, which answers 404). A task credential (Q5) always goes to the view."""

    @staticmethod
    def key(authorization: bytes, kwargs: dict) -> tuple[str, str] | None:
        token = owner_tokens.key(authorization)
        return None if token is None or "approval_id" not in kwargs else (token, str(kwargs["approval_id"]))

    @staticmethod
    def cached(key: tuple[str, str]) -> Approval | None:
        owner = owner_tokens.cached(key[0])
        if owner is None or approvals.approval_owners.owner(key[1]) != owner.pk:
            return None
        return Approval(pk=uuid.UUID(key[1]), owner_id=owner.pk)

    @staticmethod
    def warm(keys: list[tuple[str, str]]) -> None:
        owner_tokens.warm([token for token, _ in keys])
        approvals.approval_owners.warm([approval_id for _, approval_id in keys])


class ApprovalDetail(APIView):
    """``GET /api/approvals/{id}/`` (Q3): the approval, at once; with ``?wait=S`` and
    while it is pending, held until it is decided, expires or S seconds pass (a
    long-poll of ``config.asgi.LONG_POLL_VIEWS``, declared in ``long_poll``: no thread
    or connection held; an owner's usual wait starts on the event loop, ``OwnersApproval``)."""

    permission_classes = [IsOwnerOrTaskCredential]
    long_poll = LongPoll(
        wait=lambda approval, wait_s: approvals.approval_wait(approval=approval, wait_s=wait_s), render=approval_dict,
        quick_auth=OwnersApproval, query=ApprovalWaitQuery,
        keepalive=False,  # the hook bounds each read by its wait plus slack, not by silence
    )

    @extend_schema(parameters=[ApprovalWaitQuery], responses={200: shape(ApprovalShape), **errors()})
    def get(self, request, approval_id):
        params = valid_query(ApprovalWaitQuery, request)
        return self.long_poll.answer(_visible(request, approval_id), params["wait"])


class ApprovalDecision(APIView):
    """``POST /api/approvals/{id}/decision/`` (Q2), owner only, with an Idempotency-Key."""

    @extend_schema(
        request=DecisionIn, responses={200: shape(ApprovalShape), **errors(409, 422)},
        parameters=[OpenApiParameter(
            "Idempotency-Key", str, OpenApiParameter.HEADER, required=True,
            description="1-255 printable ASCII; the same key and body replay the stored answer with "
                        "Idempotent-Replayed: true. 409 already_decided carries the approval as decided.")],
    )
    def post(self, request, approval_id):
        valid_query(NoQuery, request)
        key = parse_idempotency_key(request.headers.get("Idempotency-Key"))
        data = valid_body(DecisionIn, request)
        now = clock.now()
        approval = approvals.approval_to_decide(owner=request.user, approval_id=approval_id, now=now)
        return respond_once(
            IdempotencyRecord, owner=request.user, scope=approvals.decision_scope(approval.pk), key=key,
            digest=body_digest(request.data), now=now,
            work=lambda: approvals.approval_decide(approval, behavior=data["behavior"], message=data["message"],
                                                   scope=data.get("scope", ""), actor=actor_owner(request.user),
                                                   now=now))


class ApprovalTerminal(APIView):
    """``POST /api/approvals/{id}/terminal/`` (Q4), owner only: answered in the terminal."""

    @extend_schema(request=EmptyBody, responses={200: shape(ApprovalShape), **errors(409)})
    def post(self, request, approval_id):
        valid_query(NoQuery, request)
        valid_body(EmptyBody, request)
        approval = approvals.approval_answered_in_terminal(owner=request.user, approval_id=approval_id,
                                                           now=clock.now())
        return Response(approval_dict(approval))
