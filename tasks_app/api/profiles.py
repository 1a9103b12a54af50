"""``PUT /api/worker/profiles/`` (SPEC B10, H): a machine reports its profiles."""
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.response import Response

from core import clock
from core.schema import errors, shape
from core.strict import NoQuery, StrictSerializer, valid_body, valid_query
from tasks_app.api.views import MachineView
from tasks_app.auth import request_machine
from tasks_app.services.profiles import MAX_PROFILES, machine_profiles_report
from tasks_app.shapes import ProfilesShape, profiles_dict


class ProfileSerializer(StrictSerializer):
    name = serializers.CharField(max_length=100)
    preset = serializers.CharField(max_length=50, allow_null=True)
    isolation = serializers.ChoiceField(["none", "worktree"], required=False)  # G7
    conversation = serializers.ChoiceField(["live", "resume", "none"], required=False)  # C1


class ProfilesSerializer(StrictSerializer):
    profiles = ProfileSerializer(many=True, max_length=MAX_PROFILES)

    def validate_profiles(self, value):
        names = [p["name"] for p in value]
        if len(names) != len(set(names)):
            raise serializers.ValidationError("profile names must be unique")
        return value


class WorkerProfiles(MachineView):
    """The machine's ``{"profiles": [{"name", "preset", "isolation"?}]}``, sent by the worker at start;
    answers the stored list. A change is published as a ``machine`` event (B2)."""

    @extend_schema(request=ProfilesSerializer, responses={200: shape(ProfilesShape), **errors()})
    def put(self, request):
        valid_query(NoQuery, request)
        data = valid_body(ProfilesSerializer, request)
        machine = machine_profiles_report(
            machine=request_machine(request), profiles=data["profiles"], now=clock.now()
        )
        return Response(profiles_dict(machine))
