"""Input validation of the sessions API (SPEC H, M, S). Every input serializer is a
``core.strict.StrictSerializer``: unknown fields and wrong JSON types answer 400 (K3).
Answers are rendered, and described for OpenAPI, by the shapes of
``sessions_app/shapes.py``."""
from rest_framework import serializers

from core.strict import StrictSerializer, valid_message_text
from machine.protocol import TURN_REPLY_MAX_CHARS as REPLY_MAX

from sessions_app.models import Attention, Channel, JobMode, MarkerState, SessionMessageState

# A device id names one app instance (M5): a machine id, or ``<hostname>:<session id>``.
DEVICE_ID_RE = r"^[^/\s]{1,200}$"
TOKEN_RE = r"^[^/\s]{1,100}$"


# I6: the agent CLIs that report sessions (the hooks, SPEC I), blank for any other client.
SESSION_AGENTS = ["", "claude", "codex", "gemini", "opencode", "aider"]


def absolute_or_blank(value: str) -> str:
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
                                validators=[absolute_or_blank], trim_whitespace=False)
    # T1: the paired machine the session runs on and its channel (the hooks and the
    # terminal wrapper send them; given for an existing session, they re-bind it).
    machine = serializers.UUIDField(required=False, allow_null=True, default=None)
    channel = serializers.ChoiceField(choices=Channel.choices, required=False, allow_null=True, default=None)


class SessionMessageIn(StrictSerializer):
    """``POST /api/sessions/{id}/messages/`` (T2): ``{text}``."""

    text = serializers.CharField(trim_whitespace=False, allow_blank=True)

    def validate_text(self, value):
        return valid_message_text(value)


class SessionDeliveryIn(StrictSerializer):
    """``POST /api/sessions/{id}/messages/{seq}/delivery/`` (T2-T4): what became of a message."""

    state = serializers.ChoiceField(choices=[SessionMessageState.DELIVERED, SessionMessageState.ANSWERED,
                                             SessionMessageState.UNDELIVERED])
    # T4: the Stop hook's claim names itself, so that its own retry is answered 200 and
    # any other claimant 409.
    claim = serializers.RegexField(TOKEN_RE, required=False)


class SessionUpdateIn(StrictSerializer):
    """``PATCH /api/sessions/{id}/``: ``title`` and/or I6 ``attention`` (``""`` or
    ``permission``) with ``attention_message`` (only with ``permission``)."""

    title = serializers.CharField(max_length=300, allow_blank=True, required=False)
    attention = serializers.ChoiceField(choices=[Attention.NONE, Attention.PERMISSION], allow_blank=True,
                                        required=False)
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
    # T6: with ``ended``, the turn's last assistant message (Claude Code's Stop hook).
    reply = serializers.CharField(max_length=REPLY_MAX, required=False, allow_blank=True, default="",
                                  trim_whitespace=False)


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
