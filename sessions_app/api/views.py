"""Sessions API (SPEC H): views parse and authorise, ``sessions_app.services`` decides."""
from drf_spectacular.utils import extend_schema
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
from sessions_app import services
from sessions_app.api import serializers as s
from sessions_app.models import Session
from sessions_app.shapes import (
    ActiveSessionsShape,
    JobShape,
    MarkerWriteShape,
    SessionShape,
    StopShape,
    SweepShape,
    active_sessions_dict,
    job_dict,
    marker_write_dict,
    session_dict,
    stop_dict,
)
from tasks_app.auth import IsOwnerOrMachine, request_machine


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
            now=now,
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
