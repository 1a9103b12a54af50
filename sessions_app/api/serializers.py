"""Input validation of the sessions API (SPEC H, M, S), and the OpenAPI description of
its answers (the ``*Out`` classes). Every input serializer is a
``config.strict.StrictSerializer``: unknown fields and wrong JSON types answer 400 (K3).
Answers are rendered by ``sessions_app/shapes.py``; the ``*Out`` classes only document
those shapes and must list the same fields."""
from rest_framework import serializers

from config.strict import StrictSerializer

from sessions_app.models import Attention, Job, JobMode, Marker, MarkerState, Session

# A device id names one app instance (M5): a machine id, or ``<hostname>:<session id>``.
DEVICE_ID_RE = r"^[^/\s]{1,200}$"
TOKEN_RE = r"^[^/\s]{1,100}$"


# I6: the agent CLIs that report sessions (the hooks, SPEC I), blank for any other client.
SESSION_AGENTS = ["", "claude", "codex", "gemini", "opencode", "aider"]


def _absolute_or_blank(value: str) -> str:
    if value and not value.startswith("/"):
        raise serializers.ValidationError("must be an absolute path or blank")
    if "\x00" in value:
        raise serializers.ValidationError("must not contain NUL")
    return value


class SessionCreateIn(StrictSerializer):
    id = serializers.UUIDField(required=False)
    title = serializers.CharField(max_length=300, required=False, allow_blank=True, default="")
    agent = serializers.ChoiceField(choices=SESSION_AGENTS, required=False, default="")
    cwd = serializers.CharField(max_length=1024, required=False, allow_blank=True, default="",
                                validators=[_absolute_or_blank], trim_whitespace=False)


class SessionUpdateIn(StrictSerializer):
    """``PATCH /api/sessions/{id}/``: ``title`` and/or I6 ``attention`` (``""`` or
    ``permission``) with ``attention_message`` (only with ``permission``)."""

    title = serializers.CharField(max_length=300, allow_blank=True, required=False)
    attention = serializers.ChoiceField(choices=Attention.values, allow_blank=True, required=False)
    attention_message = serializers.CharField(max_length=500, allow_blank=True, required=False)

    def validate(self, data):
        if not data:
            raise serializers.ValidationError("give title and/or attention")
        if "attention_message" in data and data.get("attention") != Attention.PERMISSION:
            raise serializers.ValidationError({"attention_message": "only with attention \"permission\""})
        return data


class MarkerIn(StrictSerializer):
    turn_id = serializers.RegexField(TOKEN_RE)
    device_id = serializers.RegexField(DEVICE_ID_RE)
    device_name = serializers.CharField(max_length=200, required=False, allow_blank=True, default="")
    state = serializers.ChoiceField(choices=MarkerState.choices)
    deep_research = serializers.BooleanField(required=False, default=False)


class DeviceIn(StrictSerializer):
    device_id = serializers.RegexField(DEVICE_ID_RE)


class JobIn(StrictSerializer):
    job_id = serializers.RegexField(r"^[^/\s]{1,200}$")
    mode = serializers.ChoiceField(choices=JobMode.choices, required=False, allow_null=True, default=None)
    auto_backgrounded = serializers.BooleanField(required=False, default=False)

    def validate(self, data):
        if data["mode"] is None and not data["auto_backgrounded"]:
            raise serializers.ValidationError({"mode": "required unless auto_backgrounded is true"})
        return data


class JobFinishIn(StrictSerializer):
    wakes = serializers.BooleanField()


class MarkerOut(serializers.ModelSerializer):
    running = serializers.BooleanField(read_only=True, help_text="M3 on the service clock at the time of the answer")

    class Meta:
        model = Marker
        fields = [
            "session_id", "device_id", "device_name", "turn_id", "state", "deep_research",
            "started_at", "expires_at", "ended_at", "version", "running",
        ]


class JobOut(serializers.ModelSerializer):
    counts = serializers.BooleanField(read_only=True, help_text="whether it keeps the session busy now (S3, S4, S7)")

    class Meta:
        model = Job
        fields = [
            "job_id", "mode", "auto_backgrounded", "created_at", "finished_at", "wakes", "consumed_at",
            "cancelled_at", "version", "counts",
        ]


class SessionOut(serializers.ModelSerializer):
    markers = MarkerOut(many=True, read_only=True)
    attention = serializers.CharField(read_only=True, help_text='I6: "" or "permission" (needs you)')

    class Meta:
        model = Session
        fields = [
            "id", "title", "agent", "cwd", "attention", "attention_message", "attention_since", "status",
            "status_since", "version", "created_at", "markers",
        ]


class MarkerWriteOut(serializers.Serializer):
    outcome = serializers.ChoiceField(choices=["applied", "not_applied"])
    reason = serializers.CharField(required=False)
    marker = MarkerOut(allow_null=True)


class SweepOut(serializers.Serializer):
    closed = serializers.IntegerField()


class StopOut(serializers.Serializer):
    markers_closed = serializers.IntegerField()
    jobs_cancelled = serializers.IntegerField()
    tasks_cancelled = serializers.IntegerField()
    status = serializers.CharField()
    version = serializers.IntegerField()


class ActiveSessionOut(serializers.Serializer):
    id = serializers.UUIDField()
    status = serializers.CharField()
    since = serializers.DateTimeField(source="status_since")


class ActiveOut(serializers.Serializer):
    sessions = ActiveSessionOut(many=True)
    server_time = serializers.DateTimeField()
