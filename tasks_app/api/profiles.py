"""``PUT /api/worker/profiles/`` (SPEC B10, H): a machine reports its profiles."""
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.response import Response

from config import clock
from tasks_app.api.serializers import StrictSerializer
from tasks_app.api.views import MachineView
from tasks_app.auth import request_machine
from tasks_app.services.profiles import MAX_PROFILES, machine_profiles_report


class ProfileSerializer(StrictSerializer):
    name = serializers.CharField(max_length=100)
    preset = serializers.CharField(max_length=50, allow_null=True)


class ProfilesSerializer(StrictSerializer):
    profiles = ProfileSerializer(many=True, max_length=MAX_PROFILES)

    def validate_profiles(self, value):
        names = [p["name"] for p in value]
        if len(names) != len(set(names)):
            raise serializers.ValidationError("profile names must be unique")
        return value


_ANSWER = inline_serializer("WorkerProfiles", {"profiles": serializers.ListField(child=serializers.DictField())})


class WorkerProfiles(MachineView):
    """The machine's ``{"profiles": [{"name", "preset"}]}``, sent by the worker at start;
    answers the stored list. A change is published as a ``machine`` event (B2)."""

    @extend_schema(request=ProfilesSerializer, responses=_ANSWER)
    def put(self, request):
        serializer = ProfilesSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        machine = machine_profiles_report(
            machine=request_machine(request), profiles=serializer.validated_data["profiles"], now=clock.now()
        )
        return Response({"profiles": machine.profiles})
