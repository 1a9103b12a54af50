"""``POST /api/worker/progress/`` (SPEC G4, H): a machine's live progress of a running task."""
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.response import Response

from config import clock
from config.schema import errors
from config.strict import NoQuery, valid_body, valid_query
from tasks_app.agent_facts import FactsError, clean_usage
from config.strict import StrictSerializer
from tasks_app.api.throttling import MachineProgressRate
from tasks_app.api.views import MachineView
from tasks_app.auth import request_machine
from tasks_app.services.progress import progress_apply

SEQ_MAX = 2**53
OUTPUT_TAIL_CHARS_MAX = 64 * 1024  # refused above this; stored bounded much lower


class ProgressSerializer(StrictSerializer):
    operation_id = serializers.UUIDField()
    seq = serializers.IntegerField(min_value=1, max_value=SEQ_MAX)
    output_tail = serializers.CharField(allow_blank=True, trim_whitespace=False, max_length=OUTPUT_TAIL_CHARS_MAX)
    last_message = serializers.CharField(allow_null=True, allow_blank=True, trim_whitespace=False,
                                         max_length=OUTPUT_TAIL_CHARS_MAX)
    usage = serializers.JSONField(allow_null=True)

    def validate_usage(self, value):
        try:
            return clean_usage(value)
        except FactsError as exc:
            raise serializers.ValidationError(str(exc))


class ProgressAnswerOut(serializers.Serializer):
    outcome = serializers.ChoiceField(["applied", "not_applied"])
    reason = serializers.ChoiceField(["stale_seq", "final"], required=False)


class WorkerProgress(MachineView):
    """G4: the latest progress is kept on the task and pushed as ``task.progress``; a seq
    not above the last, or a final task, answers ``not_applied``."""

    throttle_classes = [MachineProgressRate]  # K3: per machine, RUNSTEAD_PROGRESS_RATE

    @extend_schema(request=ProgressSerializer, responses={200: ProgressAnswerOut, **errors(429)})
    def post(self, request):
        valid_query(NoQuery, request)
        data = valid_body(ProgressSerializer, request)
        answer = progress_apply(machine=request_machine(request), operation_id=data["operation_id"], seq=data["seq"],
                                output_tail=data["output_tail"], last_message=data["last_message"] or None,
                                usage=data["usage"], now=clock.now())
        return Response(answer)
