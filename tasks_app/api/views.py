"""Task API views: parse, authorise, call one service, render (SPEC H)."""
from django.db import transaction
from django.http import HttpResponse
from django.shortcuts import get_object_or_404
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import generics, status
from rest_framework.authtoken.models import Token
from rest_framework.permissions import AllowAny
from rest_framework.response import Response
from rest_framework.views import APIView

from core import clock
from core.actors import actor_owner
from core.idempotency import body_digest, parse_idempotency_key, respond_once
from core.longpoll import LongPoll
from core.schema import errors, shape
from core.pagination import PageQuery
from core.strict import EmptyBody, NoQuery, valid_body, valid_query
from tasks_app.api import serializers as s
from tasks_app.api.throttling import OwnerAcceptRate
from tasks_app.auth import IsMachine, MachineAuthentication, machine_tokens, request_machine
from tasks_app.models import Budget, Grant, IdempotencyRecord, Machine, Pool, Task
from tasks_app.services import (
    acceptance,
    cancel,
    conversation,
    integration,
    leases,
    messages,
    pairing,
    pools,
    receipts,
    revocation,
    sync,
)
from tasks_app.shapes import (
    AckShape,
    BudgetShape,
    ConversationMessageShape,
    ConversationMessagesShape,
    GrantShape,
    LeaseShape,
    MachineShape,
    MessagesShape,
    PairingCodeShape,
    PoolShape,
    ReceiptAnswerShape,
    SyncAnswerShape,
    TaskDetailShape,
    TaskShape,
    TokenShape,
    WorkerPairShape,
    budget_dict,
    conversation_message_dict,
    grant_dict,
    lease_dict,
    machine_dict,
    messages_dict,
    paired_dict,
    pairing_code_dict,
    pool_dict,
    task_detail_dict,
    task_dict,
)


def _no_input(request) -> None:
    """An action without input still refuses any query parameter or body field (K3)."""
    valid_query(NoQuery, request)
    valid_body(EmptyBody, request)


_IDEMPOTENCY_KEY = OpenApiParameter(
    "Idempotency-Key", str, OpenApiParameter.HEADER, required=True,
    description="1-255 printable ASCII; a replay returns the stored answer with Idempotent-Replayed: true")


def _json(status_code: int, body: str) -> HttpResponse:
    return HttpResponse(body, status=status_code, content_type="application/json")


class TaskListCreate(generics.GenericAPIView):
    """GET: the owner's tasks (paginated). POST: accept a task (A1-A8)."""

    serializer_class = s.TaskCreateSerializer
    query_serializer_class = s.TaskListQuery

    def get_throttles(self):
        """Acceptances are rate-limited per owner (K3, ``RUNSTEAD_ACCEPT_RATE``); reads are not."""
        return [OwnerAcceptRate()] if self.request.method == "POST" else []

    @extend_schema(operation_id="tasks_list", parameters=[s.TaskListQuery], responses={200: shape(TaskShape, many=True), **errors()})
    def get(self, request):
        """B11: newest first, ties broken by id; filters by state, machine and session, and
        ``q`` (prompt contains, case-insensitive); filters combine with AND."""
        params = valid_query(s.TaskListQuery, request)
        tasks = Task.objects.filter(owner=request.user).select_related("integration__decided_by")
        for name in ("state", "machine", "session"):
            if name in params:
                tasks = tasks.filter(**{name: params[name]})
        if "q" in params:
            tasks = tasks.filter(prompt__icontains=params["q"])
        page = self.paginate_queryset(tasks)
        return self.get_paginated_response([task_dict(t) for t in page])

    @extend_schema(
        request=s.TaskCreateSerializer,
        responses={201: shape(TaskShape), **errors(409, 413, 422, 429)},
        parameters=[
            OpenApiParameter(
                "Idempotency-Key", str, OpenApiParameter.HEADER, required=True,
                description="1-255 printable ASCII; replays return the stored response with "
                "Idempotent-Replayed: true; records are kept until the task is final plus the retention window.",
            )
        ],
    )
    def post(self, request):
        valid_query(NoQuery, request)
        key = parse_idempotency_key(request.headers.get("Idempotency-Key"))
        data = valid_body(s.TaskCreateSerializer, request)
        now = clock.now()
        return respond_once(IdempotencyRecord, owner=request.user, scope=acceptance.ACCEPT_SCOPE, key=key,
                            digest=body_digest(request.data), now=now,
                            work=lambda: acceptance.task_accept(owner=request.user, data=data, now=now))


class TaskDetail(APIView):
    @extend_schema(request=None, responses={200: shape(TaskDetailShape), **errors()})
    def get(self, request, task_id):
        valid_query(NoQuery, request)
        task = get_object_or_404(Task, pk=task_id, owner=request.user)
        return Response(task_detail_dict(task))


class TaskCancel(APIView):
    """J7."""

    @extend_schema(request=EmptyBody, responses={200: shape(TaskShape), **errors(409)})
    def post(self, request, task_id):
        _no_input(request)
        task = get_object_or_404(Task, pk=task_id, owner=request.user)
        task = cancel.task_cancel(task=task, actor=actor_owner(request.user), now=clock.now())
        return Response(task_dict(task))


class TaskIntegrate(APIView):
    """G7: merge or discard a final worktree task's branch, once (Idempotency-Key, A1)."""

    @extend_schema(
        request=s.IntegrateSerializer, responses={202: shape(TaskShape), **errors(409, 422)},
        parameters=[_IDEMPOTENCY_KEY],
    )
    def post(self, request, task_id):
        valid_query(NoQuery, request)
        key = parse_idempotency_key(request.headers.get("Idempotency-Key"))
        data = valid_body(s.IntegrateSerializer, request)
        now = clock.now()
        return respond_once(
            IdempotencyRecord, owner=request.user, scope=acceptance.ACCEPT_SCOPE, key=key,
            digest=integration.decision_digest(task_id, request.data), now=now,
            work=lambda: integration.task_integrate(owner=request.user, task_id=task_id, action=data["action"], now=now))


class TaskMessages(APIView):
    """C2: GET the conversation's messages in seq order; POST one (Idempotency-Key, A1-A4),
    queued or steered (C9)."""

    @extend_schema(operation_id="task_messages_list", request=None,
                   responses={200: shape(ConversationMessagesShape), **errors()})
    def get(self, request, task_id):
        valid_query(NoQuery, request)
        task = get_object_or_404(Task, pk=task_id, owner=request.user)
        return Response({"results": [conversation_message_dict(m) for m in conversation.conversation_messages(task)]})

    @extend_schema(request=s.MessageCreateSerializer, responses={201: shape(ConversationMessageShape),
                                                                 **errors(409, 422)},
                   parameters=[_IDEMPOTENCY_KEY])
    def post(self, request, task_id):
        valid_query(NoQuery, request)
        key = parse_idempotency_key(request.headers.get("Idempotency-Key"))
        data = valid_body(s.MessageCreateSerializer, request)
        now = clock.now()
        return respond_once(
            IdempotencyRecord, owner=request.user, scope=conversation.message_scope(task_id), key=key,
            digest=body_digest(request.data), now=now,
            work=lambda: conversation.message_accept(owner=request.user, task_id=task_id, text=data["text"], now=now,
                                                     delivery=data["delivery"]))


class TaskMessageWithdraw(APIView):
    """C10: take back a message the worker has not claimed yet (one of withdraw and the
    worker's delivery wins; 409 ``already_delivered`` when delivery did)."""

    @extend_schema(request=EmptyBody, responses={200: shape(ConversationMessageShape), **errors(409)})
    def post(self, request, task_id, seq):
        _no_input(request)
        return Response(conversation.message_withdraw(owner=request.user, task_id=task_id, seq=seq, now=clock.now()))


class TaskInterrupt(APIView):
    """C4: stop the live conversation's current turn; the agent stays."""

    @extend_schema(request=EmptyBody, responses={202: shape(TaskShape), **errors(409)})
    def post(self, request, task_id):
        _no_input(request)
        task = conversation.task_interrupt(owner=request.user, task_id=task_id, now=clock.now())
        return Response(task, status=status.HTTP_202_ACCEPTED)


class TaskEnd(APIView):
    """C5: end the conversation (a live agent's input is closed; it finishes by itself)."""

    @extend_schema(request=EmptyBody, responses={200: shape(TaskShape), **errors(409)})
    def post(self, request, task_id):
        _no_input(request)
        return Response(conversation.task_end(owner=request.user, task_id=task_id, now=clock.now()))


class OwnerTokenRotate(APIView):
    """``POST /api/token/rotate/``: replace the caller's API token (K1); the old one stops
    working at once. Returns ``{"token"}``."""

    @extend_schema(request=EmptyBody, responses={201: shape(TokenShape), **errors()})
    def post(self, request):
        _no_input(request)
        with transaction.atomic():
            Token.objects.filter(user=request.user).delete()
            token = Token.objects.create(user=request.user)
        return Response(TokenShape(token=token.key), status=status.HTTP_201_CREATED)


class BudgetView(APIView):
    @extend_schema(request=None, responses={200: shape(BudgetShape), **errors()})
    def get(self, request):
        valid_query(NoQuery, request)
        budget = get_object_or_404(Budget, owner=request.user)
        return Response(budget_dict(budget))


class MachineList(generics.GenericAPIView):
    @extend_schema(request=None, parameters=[PageQuery], responses={200: shape(MachineShape, many=True), **errors()})
    def get(self, request):
        now = clock.now()
        page = self.paginate_queryset(Machine.objects.filter(owner=request.user))
        return self.get_paginated_response([machine_dict(m, now=now) for m in page])


class MachineUnpair(APIView):
    """P1, P3."""

    @extend_schema(request=EmptyBody, responses={200: shape(MachineShape), **errors()})
    def post(self, request, machine_id):
        _no_input(request)
        machine = get_object_or_404(Machine, pk=machine_id, owner=request.user)
        now = clock.now()
        machine = revocation.machine_unpair(machine=machine, actor=actor_owner(request.user), now=now)
        return Response(machine_dict(machine, now=now))


class PairingCodeCreate(APIView):
    @extend_schema(request=s.PairingCodeSerializer, responses={201: shape(PairingCodeShape), **errors()})
    def post(self, request):
        valid_query(NoQuery, request)
        data = valid_body(s.PairingCodeSerializer, request)
        code, row = pairing.pairing_code_create(
            owner=request.user, name=data.get("name", ""), machine_id=data.get("machine"), now=clock.now(),
        )
        return Response(pairing_code_dict(code, row), status=status.HTTP_201_CREATED)


class GrantListCreate(generics.GenericAPIView):
    serializer_class = s.GrantCreateSerializer

    @extend_schema(request=None, parameters=[PageQuery], responses={200: shape(GrantShape, many=True), **errors()})
    def get(self, request):
        page = self.paginate_queryset(Grant.objects.filter(owner=request.user))
        return self.get_paginated_response([grant_dict(g) for g in page])

    @extend_schema(request=s.GrantCreateSerializer, responses={201: shape(GrantShape), 200: shape(GrantShape), **errors(409)})
    def post(self, request):
        valid_query(NoQuery, request)
        data = valid_body(s.GrantCreateSerializer, request)
        grant, created = revocation.grant_create(
            owner=request.user, machine_id=data["machine"], path=data["path"], now=clock.now(),
        )
        return Response(grant_dict(grant), status=status.HTTP_201_CREATED if created else status.HTTP_200_OK)


class GrantRevoke(APIView):
    @extend_schema(request=EmptyBody, responses={200: shape(GrantShape), **errors()})
    def post(self, request, grant_id):
        _no_input(request)
        grant = get_object_or_404(Grant, pk=grant_id, owner=request.user)
        grant = revocation.grant_revoke(grant=grant, actor=actor_owner(request.user), now=clock.now())
        return Response(grant_dict(grant))


class PoolListCreate(generics.GenericAPIView):
    """C8: the owner's machine pools. GET lists them (paginated); POST creates one
    ``{"name", "machines"?}`` -> 201; 403 ``machine_forbidden``, 409 ``pool_exists``."""

    serializer_class = s.PoolCreateSerializer

    @extend_schema(request=None, parameters=[PageQuery], responses={200: shape(PoolShape, many=True), **errors()})
    def get(self, request):
        page = self.paginate_queryset(Pool.objects.filter(owner=request.user).prefetch_related("machines"))
        return self.get_paginated_response([pool_dict(p) for p in page])

    @extend_schema(request=s.PoolCreateSerializer, responses={201: shape(PoolShape), **errors(409)})
    def post(self, request):
        valid_query(NoQuery, request)
        data = valid_body(s.PoolCreateSerializer, request)
        pool = pools.pool_create(owner=request.user, name=data["name"], machine_ids=data["machines"], now=clock.now())
        return Response(pool_dict(pool), status=status.HTTP_201_CREATED)


class PoolDetail(APIView):
    """C8: one of the owner's pools (another owner's id: 404, K2). PATCH renames it and/or
    replaces its machines; DELETE removes it (its machines and tasks stay)."""

    @extend_schema(request=None, responses={200: shape(PoolShape), **errors()})
    def get(self, request, pool_id):
        valid_query(NoQuery, request)
        return Response(pool_dict(get_object_or_404(Pool, pk=pool_id, owner=request.user)))

    @extend_schema(request=s.PoolUpdateSerializer, responses={200: shape(PoolShape), **errors(409)})
    def patch(self, request, pool_id):
        valid_query(NoQuery, request)
        pool = get_object_or_404(Pool, pk=pool_id, owner=request.user)
        data = valid_body(s.PoolUpdateSerializer, request)
        pool = pools.pool_update(pool=pool, name=data.get("name"), machine_ids=data.get("machines"), now=clock.now())
        return Response(pool_dict(pool))

    @extend_schema(request=EmptyBody, responses={204: None, **errors()})
    def delete(self, request, pool_id):
        _no_input(request)
        pools.pool_delete(pool=get_object_or_404(Pool, pk=pool_id, owner=request.user))
        return Response(status=status.HTTP_204_NO_CONTENT)


# --- worker endpoints ------------------------------------------------------------------


class MachineView(APIView):
    """Base of the worker endpoints: a machine token, and ``last_heard_at`` written
    outside the business transaction (P2)."""

    permission_classes = [IsMachine]
    heard_by_service = False  # the service records the machine heard itself (the pull's start)

    def get_authenticate_header(self, request):
        """A 401's ``WWW-Authenticate`` names the machine scheme (owners' endpoints: ``Token``)."""
        return MachineAuthentication.keyword

    def initial(self, request, *args, **kwargs):
        super().initial(request, *args, **kwargs)
        if not self.heard_by_service:
            pairing.machines_heard([request_machine(request)], now=clock.now())


class WorkerPair(APIView):
    """Exchange a pairing code for a machine token (K1)."""

    permission_classes = [AllowAny]
    authentication_classes = []

    @extend_schema(request=s.PairSerializer, responses={201: shape(WorkerPairShape), **errors(429)})
    def post(self, request):
        valid_query(NoQuery, request)
        data = valid_body(s.PairSerializer, request)
        machine, token = pairing.machine_pair(
            code=data["code"], name=data.get("name", ""),
            client=request.META.get("REMOTE_ADDR", "")[:64], now=clock.now(),
        )
        return Response(paired_dict(machine, token), status=status.HTTP_201_CREATED)


class WorkerMessages(MachineView):
    """Long-poll the outbox (W2, W5, D1): parses and authorises; the wait it declares is
    performed by the long-poll engine (``core.longpoll``), which also answers the idle
    worker's usual pull on the event loop from these declarations (issue 22)."""

    # Every idle worker starts a pull every ~25 s: its token is looked up through this
    # process's ``tasks_app.auth.MachineTokenCache`` (K1 as without it), here and on the
    # engine's fast path (``quick_auth``).
    machine_token_cached = True
    heard_by_service = True  # with the other pull starts of the event loop (messages_starts)
    long_poll = LongPoll(
        wait=lambda machine, wait_s: messages.messages_wait(machine=machine, wait_s=wait_s),
        render=messages_dict, quick_auth=machine_tokens, query=s.MessagesQuery,
        render_in_thread=False,  # the messages the take loaded, nothing else
    )

    @extend_schema(parameters=[s.MessagesQuery], responses={200: shape(MessagesShape), **errors()})
    def get(self, request):
        wait = valid_query(s.MessagesQuery, request)["wait"]
        return self.long_poll.answer(request_machine(request), wait)


class WorkerMessageAck(MachineView):
    @extend_schema(request=EmptyBody, responses={200: shape(AckShape), **errors()})
    def post(self, request, message_id):
        _no_input(request)
        messages.message_ack(machine=request_machine(request), message_id=message_id, now=clock.now())
        return Response(AckShape(acked=True))


class WorkerLeaseGrant(MachineView):
    """L1, L2; Q5: with ``approval_credential`` the answer's ``approval`` carries the
    task's approval credential (a fresh one each answer; the earlier one stops working)."""

    @extend_schema(request=s.LeaseGrantSerializer, responses={201: shape(LeaseShape), 200: shape(LeaseShape), **errors(409)})
    def post(self, request):
        valid_query(NoQuery, request)
        data = valid_body(s.LeaseGrantSerializer, request)
        lease, created, credential = leases.lease_grant_answer(
            machine=request_machine(request), operation_id=data["operation_id"],
            approval_credential=data["approval_credential"], now=clock.now(),
        )
        return Response(lease_dict(lease, approval=credential),
                        status=status.HTTP_201_CREATED if created else status.HTTP_200_OK)


class WorkerLeaseRenew(MachineView):
    """L2, L5, L10."""

    machine_token_cached = True  # as the sync's (WorkerSync)

    @extend_schema(request=s.LeaseRenewSerializer, responses={200: shape(LeaseShape), **errors(409)})
    def post(self, request, lease_id):
        valid_query(NoQuery, request)
        data = valid_body(s.LeaseRenewSerializer, request)
        lease = leases.lease_renew(
            machine=request_machine(request), lease_id=lease_id, output_tail=data.get("output_tail"), now=clock.now(),
        )
        return Response(lease_dict(lease))


class WorkerReceipts(MachineView):
    """R1-R3."""

    @extend_schema(request=s.ReceiptSerializer, responses={200: shape(ReceiptAnswerShape), **errors()})
    def post(self, request):
        valid_query(NoQuery, request)
        data = valid_body(s.ReceiptSerializer, request)
        code, body = receipts.receipt_apply(machine=request_machine(request), receipt=data, now=clock.now())
        return _json(code, body)


class WorkerSync(MachineView):
    """One request renews the machine's leases and carries a batch of its receipts
    (``services.sync``; L2, L5, L10, R1-R3): 200 with one answer per item."""

    # Every busy machine syncs once per renewal interval (issue 44): its token comes from
    # ``MachineTokenCache`` as the pull's does, one statement and one transaction less a
    # sync. K1 holds: a renewal and a receipt read their machine's row again under lock
    # (paired at the lease's generation, L2; the receipt's generation, R2).
    machine_token_cached = True

    @extend_schema(request=s.SyncSerializer, responses={200: shape(SyncAnswerShape), **errors()})
    def post(self, request):
        valid_query(NoQuery, request)
        data = valid_body(s.SyncSerializer, request)
        return Response(sync.machine_sync(machine=request_machine(request), renew=data.get("renew", []),
                                          receipts=data.get("receipts", []), now=clock.now()))
