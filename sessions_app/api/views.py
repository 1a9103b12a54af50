"""Sessions API (SPEC H): views parse and authorise, ``sessions_app.services`` decides."""
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import status
from rest_framework.response import Response
from rest_framework.generics import GenericAPIView
from rest_framework.views import APIView

from core import clock
from core.actors import actor_machine, actor_owner
from core.errors import ApplicationError
from core.pagination import PageQuery
from core.schema import errors, shape
from core.strict import EmptyBody, NoQuery, valid_body, valid_query
from core.idempotency import body_digest, parse_idempotency_key, respond_once
from sessions_app import messages, services
from sessions_app.api import serializers as s
from sessions_app.models import Session
from sessions_app.shapes import (
    ActiveSessionsShape,
    JobShape,
    MarkerWriteShape,
    SessionMessageShape,
    SessionMessagesShape,
    SessionShape,
    StopShape,
    SweepShape,
    active_sessions_dict,
    job_dict,
    marker_write_dict,
    session_dict,
    session_message_dict,
    stop_dict,
)
from tasks_app.auth import IsOwnerOrMachine, request_machine
from tasks_app.models import IdempotencyRecord


def actor_of(request) -> str:
    machine = request_machine(request)
    return actor_machine(machine) if machine else actor_owner(request.user)


def session_out(session: Session, now) -> SessionShape:
    return session_dict(session, markers=session.markers.all(), now=now)


class SessionListView(GenericAPIView):
    serializer_class = s.SessionCreateIn

    @extend_schema(parameters=[PageQuery], responses={200: shape(SessionShape, many=True), **errors()})
    def get(self, request):
        now = clock.now()
        page = self.paginate_queryset(Session.objects.filter(owner=request.user).prefetch_related("markers"))
        return self.get_paginated_response([session_out(session, now) for session in page])

    @extend_schema(request=s.SessionCreateIn, responses={201: shape(SessionShape), 200: shape(SessionShape), **errors()})
    def post(self, request):
        data = _valid(s.SessionCreateIn, request)
        now = clock.now()
        session, created = services.session_create(
            owner=request.user, session_id=data.get("id"), title=data["title"], agent=data["agent"], cwd=data["cwd"],
            machine_id=data["machine"], channel=data["channel"], now=now,
        )
        return Response(session_out(session, now), status=status.HTTP_201_CREATED if created else status.HTTP_200_OK)


class SessionDetailView(APIView):
    def _get(self, request, session_id):
        session = Session.objects.filter(pk=session_id, owner=request.user).prefetch_related("markers").first()
        if session is None:
            raise ApplicationError("not_found", "no such session", status_code=404)
        return session

    @extend_schema(responses={200: shape(SessionShape), **errors()})
    def get(self, request, session_id):
        valid_query(NoQuery, request)
        return Response(session_out(self._get(request, session_id), clock.now()))

    @extend_schema(request=s.SessionUpdateIn, responses={200: shape(SessionShape), **errors()})
    def patch(self, request, session_id):
        data = _valid(s.SessionUpdateIn, request)
        now = clock.now()
        services.session_update(owner=request.user, session_id=session_id, now=now, **data)
        return Response(session_out(self._get(request, session_id), now))

    @extend_schema(request=EmptyBody, responses={204: None, **errors()})
    def delete(self, request, session_id):
        _valid(EmptyBody, request)
        services.session_delete(owner=request.user, session_id=session_id, now=clock.now())
        return Response(status=status.HTTP_204_NO_CONTENT)


class MarkerView(APIView):
    permission_classes = [IsOwnerOrMachine]

    @extend_schema(request=s.MarkerIn, responses={200: shape(MarkerWriteShape), **errors()})
    def put(self, request, session_id):
        data = _valid(s.MarkerIn, request)
        now = clock.now()
        result = services.marker_write(
            owner=request.user, session_id=session_id, machine=request_machine(request), now=now, **data
        )
        return Response(marker_write_dict(result, now=now))


class DeviceSweepView(APIView):
    permission_classes = [IsOwnerOrMachine]

    @extend_schema(request=EmptyBody, responses={200: shape(SweepShape), **errors()})
    def post(self, request, device_id):
        _valid(EmptyBody, request)
        s.DeviceIn(data={"device_id": device_id}).is_valid(raise_exception=True)
        closed = services.device_sweep(
            owner=request.user, device_id=device_id, machine=request_machine(request), now=clock.now()
        )
        return Response(SweepShape(closed=closed))


class JobListView(APIView):
    permission_classes = [IsOwnerOrMachine]

    @extend_schema(request=s.JobIn, responses={201: shape(JobShape), 200: shape(JobShape), **errors()})
    def post(self, request, session_id):
        data = _valid(s.JobIn, request)
        now = clock.now()
        job, created = services.job_start(owner=request.user, session_id=session_id, now=now, **data)
        return Response(job_dict(job, now=now), status=status.HTTP_201_CREATED if created else status.HTTP_200_OK)


class JobFinishView(APIView):
    permission_classes = [IsOwnerOrMachine]

    @extend_schema(request=s.JobFinishIn, responses={200: shape(JobShape), **errors()})
    def post(self, request, session_id, job_id):
        data = _valid(s.JobFinishIn, request)
        now = clock.now()
        job = services.job_finish(owner=request.user, session_id=session_id, job_id=job_id, wakes=data["wakes"], now=now)
        return Response(job_dict(job, now=now))


class SessionStopView(APIView):
    @extend_schema(request=EmptyBody, responses={200: shape(StopShape), **errors()})
    def post(self, request, session_id):
        _valid(EmptyBody, request)
        result = services.session_stop(
            owner=request.user, session_id=session_id, actor=actor_of(request), now=clock.now()
        )
        return Response(stop_dict(result))


IDEMPOTENCY_KEY = OpenApiParameter(
    "Idempotency-Key", str, OpenApiParameter.HEADER, required=True,
    description="1-255 printable ASCII; a replay returns the stored answer with Idempotent-Replayed: true")


class SessionMessagesView(APIView):
    """T2: GET the session's messages in ``seq`` order; POST one (Idempotency-Key, A1-A4)."""

    @extend_schema(operation_id="session_messages_list", request=None,
                   responses={200: shape(SessionMessagesShape), **errors()})
    def get(self, request, session_id):
        valid_query(NoQuery, request)
        found = messages.session_messages(owner=request.user, session_id=session_id)
        return Response({"results": [session_message_dict(m) for m in found]})

    @extend_schema(request=s.SessionMessageIn, responses={201: shape(SessionMessageShape), **errors(409, 422)},
                   parameters=[IDEMPOTENCY_KEY])
    def post(self, request, session_id):
        valid_query(NoQuery, request)
        key = parse_idempotency_key(request.headers.get("Idempotency-Key"))
        data = valid_body(s.SessionMessageIn, request)
        now = clock.now()
        return respond_once(
            IdempotencyRecord, owner=request.user, scope=messages.message_scope(session_id), key=key,
            digest=body_digest(request.data), now=now,
            work=lambda: messages.message_accept(owner=request.user, session_id=session_id, text=data["text"], now=now))


class SessionMessageDeliveryView(APIView):
    """T2-T4: what became of a message, reported from the session's machine (the hooks or
    the wrapper with the owner token, or the worker's machine token); ``delivered`` from
    ``sent`` is the Stop hook's claim: one caller wins, the others get 409."""

    permission_classes = [IsOwnerOrMachine]

    @extend_schema(request=s.SessionDeliveryIn, responses={200: shape(SessionMessageShape), **errors(409)})
    def post(self, request, session_id, seq):
        data = _valid(s.SessionDeliveryIn, request)
        return Response(messages.message_delivery(
            owner=request.user, session_id=session_id, seq=seq, state=data["state"],
            machine=request_machine(request), by=actor_of(request), claim=data.get("claim"), now=clock.now()))


class SessionMessageWithdrawView(APIView):
    """C10 for T2: withdraw a message not yet delivered."""

    @extend_schema(request=EmptyBody, responses={200: shape(SessionMessageShape), **errors(409)})
    def post(self, request, session_id, seq):
        _valid(EmptyBody, request)
        return Response(messages.message_withdraw(owner=request.user, session_id=session_id, seq=seq,
                                                  now=clock.now()))


class SessionInterruptView(APIView):
    """T5: stop the terminal session's current turn (the wrapper sends the CLI's interrupt key)."""

    @extend_schema(request=EmptyBody, responses={202: shape(SessionShape), **errors(409)})
    def post(self, request, session_id):
        _valid(EmptyBody, request)
        now = clock.now()
        session = messages.session_interrupt(owner=request.user, session_id=session_id, now=now)
        return Response(session_out(session, now), status=status.HTTP_202_ACCEPTED)


class ActiveSessionsView(APIView):
    @extend_schema(responses={200: shape(ActiveSessionsShape), **errors()})
    def get(self, request):
        valid_query(NoQuery, request)
        now = clock.now()
        sessions = services.sessions_active(owner=request.user, now=now)
        return Response(active_sessions_dict(sessions, now=now))


def _valid(serializer_class, request) -> dict:
    """The body validated by a strict serializer, after refusing any query parameter (K3)."""
    valid_query(NoQuery, request)
    return valid_body(serializer_class, request)
