"""``PUT /api/worker/profiles/`` (SPEC B10, H): a machine reports its profiles."""
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.response import Response

from core import clock
from core.schema import errors, shape
from core.strict import NoQuery, StrictSerializer, valid_body, valid_query
from tasks_app.api.views import MachineView
from tasks_app.auth import request_machine
from tasks_app.services.folders import folder_problem
from tasks_app.services.profiles import MAX_CONCURRENT, MAX_PROFILES, MAX_REPOSITORIES, machine_profiles_report
from tasks_app.shapes import ProfilesShape, profiles_dict


class ProfileSerializer(StrictSerializer):
    name = serializers.CharField(max_length=100)
    preset = serializers.CharField(max_length=50, allow_null=True)
    isolation = serializers.ChoiceField(["none", "worktree"], required=False)  # G7
    conversation = serializers.ChoiceField(["live", "resume", "none"], required=False)  # C1


class RepositorySerializer(StrictSerializer):
    """C8: one repository under the worker's allowed roots (``machine/worker/repositories.py``)."""

    path = serializers.CharField(max_length=4096, trim_whitespace=False)
    remote = serializers.CharField(max_length=1000, allow_null=True, trim_whitespace=False)
    root_commit = serializers.RegexField(r"^[0-9a-f]{40}([0-9a-f]{24})?$", allow_null=True)

    def validate_path(self, value):
        problem = folder_problem(value)
        if problem:
            raise serializers.ValidationError(problem)
        return value


class ProfilesSerializer(StrictSerializer):
    profiles = ProfileSerializer(many=True, max_length=MAX_PROFILES)
    max_concurrent = serializers.IntegerField(required=False, min_value=1, max_value=MAX_CONCURRENT)  # C8, W8
    repositories = RepositorySerializer(many=True, required=False, max_length=MAX_REPOSITORIES)  # C8

    def validate_profiles(self, value):
        names = [p["name"] for p in value]
        if len(names) != len(set(names)):
            raise serializers.ValidationError("profile names must be unique")
        return value


class WorkerProfiles(MachineView):
    """The machine's ``{"profiles": [{"name", "preset", "isolation"?}], "max_concurrent"?,
    "repositories"?}``, sent by the worker at start; answers the stored profile list. A change is published as a ``machine`` event (B2)."""

    @extend_schema(request=ProfilesSerializer, responses={200: shape(ProfilesShape), **errors()})
    def put(self, request):
        valid_query(NoQuery, request)
        data = valid_body(ProfilesSerializer, request)
        machine = machine_profiles_report(
            machine=request_machine(request), profiles=data["profiles"], now=clock.now(),
            max_concurrent=data.get("max_concurrent"), repositories=data.get("repositories"),
        )
        return Response(profiles_dict(machine))
