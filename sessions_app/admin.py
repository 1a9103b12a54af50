"""Admin views of sessions, markers and jobs (read-mostly: state changes go through the API)."""
from django.contrib import admin

from sessions_app.models import EndedTurn, Job, Marker, Session


class MarkerInline(admin.TabularInline):
    model = Marker
    extra = 0
    can_delete = False
    readonly_fields = [f.name for f in Marker._meta.fields]


class JobInline(admin.TabularInline):
    model = Job
    extra = 0
    can_delete = False
    readonly_fields = [f.name for f in Job._meta.fields]


@admin.register(Session)
class SessionAdmin(admin.ModelAdmin):
    list_display = ["id", "title", "owner", "status", "status_since", "created_at"]
    list_filter = ["status"]
    search_fields = ["id", "title"]
    readonly_fields = ["id", "owner", "status", "status_since", "created_at", "version"]
    inlines = [MarkerInline, JobInline]


@admin.register(Marker)
class MarkerAdmin(admin.ModelAdmin):
    list_display = ["session", "device_id", "device_name", "turn_id", "state", "started_at", "expires_at"]
    list_filter = ["state"]
    search_fields = ["device_id", "turn_id", "session__id"]
    readonly_fields = [f.name for f in Marker._meta.fields]


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    list_display = ["session", "job_id", "mode", "created_at", "finished_at", "wakes", "consumed_at", "cancelled_at"]
    list_filter = ["mode"]
    readonly_fields = [f.name for f in Job._meta.fields]


@admin.register(EndedTurn)
class EndedTurnAdmin(admin.ModelAdmin):
    list_display = ["session", "turn_id", "device_id", "ended_at"]
    readonly_fields = [f.name for f in EndedTurn._meta.fields]
