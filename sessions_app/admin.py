"""Admin views of sessions, markers, jobs and approvals (SPEC U5): markers, jobs, ended
turns and approvals are history, shown and never edited or deleted here; a session's
title is its only editable field. State changes go through the API (an approval is
answered from the board or the API, once, Q2)."""
from django.contrib import admin

from core.admin_history import HistoryAdmin, HistoryInline, OwnerScopedAdmin
from sessions_app.models import Approval, EndedTurn, Job, Marker, Session


class MarkerInline(HistoryInline):
    model = Marker


class JobInline(HistoryInline):
    model = Job


@admin.register(Session)
class SessionAdmin(OwnerScopedAdmin):
    """A session's status follows its markers and tasks (S1); only the title is editable.
    Sessions are not added or deleted here (deleting one would delete its markers, M1)."""

    list_display = ["id", "title", "owner", "status", "status_since", "created_at"]
    list_filter = ["status"]
    search_fields = ["id", "title"]
    readonly_fields = ["id", "owner", "status", "status_since", "created_at", "version"]
    inlines = [MarkerInline, JobInline]

    def has_add_permission(self, request):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(Marker)
class MarkerAdmin(HistoryAdmin):
    owner_lookup = "session__owner"
    list_display = ["session", "device_id", "device_name", "turn_id", "state", "started_at", "expires_at"]
    list_filter = ["state"]
    search_fields = ["device_id", "turn_id", "session__id"]


@admin.register(Job)
class JobAdmin(HistoryAdmin):
    owner_lookup = "session__owner"
    list_display = ["session", "job_id", "mode", "created_at", "finished_at", "wakes", "consumed_at", "cancelled_at"]
    list_filter = ["mode"]


@admin.register(EndedTurn)
class EndedTurnAdmin(HistoryAdmin):
    owner_lookup = "session__owner"
    list_display = ["session", "turn_id", "device_id", "ended_at"]


@admin.register(Approval)
class ApprovalAdmin(HistoryAdmin):
    """Q1, U5: read-only; pending ones first, then newest."""

    list_display = ["tool_name", "agent", "state", "session", "task", "created_at", "decided_at", "decided_by"]
    list_filter = ["state", "agent"]
    search_fields = ["id", "tool_name", "session__id", "task__id"]

    def get_queryset(self, request):
        from django.db.models import Case, IntegerField, Value, When

        pending_first = Case(When(state="pending", then=Value(0)), default=Value(1), output_field=IntegerField())
        return super().get_queryset(request).order_by(pending_first, "-created_at")
