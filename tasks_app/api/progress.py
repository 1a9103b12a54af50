"""Live progress and the transcript (SPEC G4, B9, H): ``POST /api/worker/progress/`` (a
machine's live progress of a running task) and ``GET /api/tasks/{id}/entries/`` (the
owner reads the task's transcript)."""
from django.shortcuts import get_object_or_404
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.utils.urls import replace_query_param, remove_query_param
from rest_framework.views import APIView

from core import clock
from core.schema import errors, shape
from core.strict import NoQuery, QueryIntegerField, StrictQuerySerializer, StrictSerializer, valid_body, valid_query
from tasks_app.agent_facts import BIG, FactsError, clean_entries, clean_usage
from tasks_app.api.throttling import MachineProgressRate
from tasks_app.api.views import MachineView
from tasks_app.auth import request_machine
from tasks_app.models import Task
from tasks_app.services.progress import TRANSCRIPT_PAGE_MAX, progress_apply, transcript_page
from tasks_app.shapes import EntriesPageShape, ProgressAnswerShape

SEQ_MAX = 2**53
OUTPUT_TAIL_CHARS_MAX = 64 * 1024  # refused above this; stored bounded much lower


class ProgressSerializer(StrictSerializer):
    operation_id = serializers.UUIDField()
    seq = serializers.IntegerField(min_value=1, max_value=SEQ_MAX)
    output_tail = serializers.CharField(allow_blank=True, trim_whitespace=False, max_length=OUTPUT_TAIL_CHARS_MAX)
    last_message = serializers.CharField(allow_null=True, allow_blank=True, trim_whitespace=False,
                                         max_length=OUTPUT_TAIL_CHARS_MAX)
    usage = serializers.JSONField(allow_null=True)
    entries = serializers.JSONField(required=False, help_text="G4: transcript entries parsed since the last post "
                                    "({n, kind, text, tool?, status?, call?, usage?, seq?}, at most 50, rising n)")

    def validate_usage(self, value):
        try:
            return clean_usage(value)
        except FactsError as exc:
            raise serializers.ValidationError(str(exc))

    def validate_entries(self, value):
        try:
            return clean_entries(value)
        except FactsError as exc:
            raise serializers.ValidationError(str(exc))


class WorkerProgress(MachineView):
    """G4: the latest progress is kept on the task and pushed as ``task.progress``; a seq
    not above the last, or a final task, answers ``not_applied``."""

    throttle_classes = [MachineProgressRate]  # K3: per machine, RUNSTEAD_PROGRESS_RATE

    @extend_schema(request=ProgressSerializer, responses={200: shape(ProgressAnswerShape), **errors(429)})
    def post(self, request):
        valid_query(NoQuery, request)
        data = valid_body(ProgressSerializer, request)
        answer = progress_apply(machine=request_machine(request), operation_id=data["operation_id"], seq=data["seq"],
                                output_tail=data["output_tail"], last_message=data["last_message"] or None,
                                usage=data["usage"], entries=data.get("entries", []), now=clock.now())
        return Response(answer)


class EntriesQuery(StrictQuerySerializer):
    """``GET /api/tasks/{id}/entries/``: ``before`` or ``after`` (an entry number), ``limit``."""

    before = QueryIntegerField(required=False, min_value=1, max_value=BIG,
                               help_text="the last entries numbered below this (load earlier)")
    after = QueryIntegerField(required=False, min_value=0, max_value=BIG,
                              help_text="the first entries numbered above this (catching up)")
    limit = QueryIntegerField(required=False, min_value=1, max_value=TRANSCRIPT_PAGE_MAX,
                              help_text=f"entries per page, 1-{TRANSCRIPT_PAGE_MAX}, default {TRANSCRIPT_PAGE_MAX}")

    def validate(self, attrs):
        if "before" in attrs and "after" in attrs:
            raise serializers.ValidationError({"non_field_errors": ["give before or after, not both"]})
        return attrs


class TaskEntries(APIView):
    """G4, B9: the task's transcript, in reading order; the last 500 entries are kept.
    Without ``after`` a page is the newest entries (below ``before``) and ``next`` links the
    page before it; with ``after`` a page is the oldest entries above it and ``next`` links
    the page after it."""

    @extend_schema(parameters=[EntriesQuery], responses={200: shape(EntriesPageShape), **errors()})
    def get(self, request, task_id):
        params = valid_query(EntriesQuery, request)
        task = get_object_or_404(Task, pk=task_id, owner=request.user)
        entries, beyond = transcript_page(task, before=params.get("before"), after=params.get("after"),
                                          limit=params.get("limit", TRANSCRIPT_PAGE_MAX))
        link = None
        if beyond is not None:
            link = request.build_absolute_uri()
            for name in ("before", "after"):
                link = remove_query_param(link, name)
            (name, value), = beyond.items()
            link = replace_query_param(link, name, value)
        page: EntriesPageShape = {"results": entries, "next": link}
        return Response(page)
