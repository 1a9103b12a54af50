"""Django admin: tasks with owner decisions on ``unknown`` ones (U3, U4)."""
from django.contrib import admin, messages
from django.db.models import Case, IntegerField, Value, When

from config import clock
from config.errors import ApplicationError
from tasks_app.models import (
    Budget, Grant, IdempotencyRecord, Lease, Machine, Operation, OutboxMessage, Receipt, Task, TaskEvent, TaskState,
)
from tasks_app.services.decisions import task_ask_again, task_clear_survivor_lock, task_decide


class EvidenceInline(admin.TabularInline):
    """Read-only history rows under a task (U4). Whoever may view the task sees them, without
    separate permissions on these models; nobody adds, edits or deletes them (append-only)."""

    extra = 0
    can_delete = False

    def has_view_permission(self, request, obj=None):
        return request.user.has_perm("tasks_app.view_task") or request.user.has_perm("tasks_app.change_task")

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


class TaskEventInline(EvidenceInline):
    model = TaskEvent
    fields = ["at", "old_state", "new_state", "reason", "actor"]
    readonly_fields = fields


class ReceiptInline(EvidenceInline):
    """The worker's receipts and answers, reports included (U4)."""

    model = Receipt
    fields = ["received_at", "kind", "event_id", "generation", "body", "response_body"]
    readonly_fields = fields


class LeaseInline(EvidenceInline):
    """Lease timeline (U4): granted, renewals, expiry."""

    model = Lease
    fields = ["granted_at", "renewals", "last_renewed_at", "expires_at", "refused_reason", "ended_at", "end_reason"]
    readonly_fields = fields


def _decide(decision):
    def action(modeladmin, request, queryset):
        now = clock.now()
        done = 0
        for task in queryset:
            try:
                task_decide(task=task, decision=decision, user=request.user, now=now)
                done += 1
            except ApplicationError as exc:
                modeladmin.message_user(request, f"{task.id}: {exc.detail}", messages.WARNING)
        modeladmin.message_user(request, f"{done} task(s) marked {decision}")

    action.__name__ = f"mark_{decision}"
    return action


@admin.register(Task)
class TaskAdmin(admin.ModelAdmin):
    """Unknown tasks first, with their evidence (U4); decisions as actions (U3)."""

    list_display = ["id", "state", "agent", "folder", "machine", "created_at", "runtime_s", "exit_code", "slept_s"]
    list_filter = ["state", "machine"]
    search_fields = ["id", "folder", "prompt"]
    inlines = [LeaseInline, TaskEventInline, ReceiptInline]
    actions = [
        admin.action(description="Mark succeeded", permissions=["change"])(_decide("succeeded")),
        admin.action(description="Mark failed", permissions=["change"])(_decide("failed")),
        admin.action(description="It never ran (abandon)", permissions=["change"])(_decide("abandoned")),
        "ask_again",
        "clear_survivor_lock",
    ]
    readonly_fields = [f.name for f in Task._meta.fields]

    def get_queryset(self, request):
        qs = super().get_queryset(request)
        if not request.user.is_superuser:
            qs = qs.filter(owner=request.user)
        return qs

    def get_ordering(self, request):
        # Unknown tasks first (U3). The changelist takes its ordering from here, not from
        # the queryset (it would fall back to Task.Meta.ordering).
        unknown_first = Case(When(state=TaskState.UNKNOWN, then=Value(0)), default=Value(1), output_field=IntegerField())
        return [unknown_first.asc(), "-created_at"]

    def has_add_permission(self, request):
        return False

    @admin.action(description="Ask the worker again", permissions=["change"])
    def ask_again(self, request, queryset):
        for task in queryset:
            try:
                task_ask_again(task=task, user=request.user, now=clock.now())
                self.message_user(request, f"{task.id}: asked the worker again")
            except ApplicationError as exc:
                self.message_user(request, f"{task.id}: {exc.detail}", messages.WARNING)

    @admin.action(description="Clear the folder lock kept for survivors", permissions=["change"])
    def clear_survivor_lock(self, request, queryset):
        for task in queryset:
            task_clear_survivor_lock(task=task, user=request.user, now=clock.now())


@admin.register(Machine)
class MachineAdmin(admin.ModelAdmin):
    list_display = ["name", "owner", "generation", "paired", "last_heard_at"]
    readonly_fields = ["token_hash", "generation"]


@admin.register(Grant)
class GrantAdmin(admin.ModelAdmin):
    list_display = ["path", "machine", "owner", "created_at", "revoked_at"]


@admin.register(Budget)
class BudgetAdmin(admin.ModelAdmin):
    list_display = ["owner", "limit_s", "reserved_s", "spent_s"]
    readonly_fields = ["reserved_s", "spent_s"]


for model, fields in [
    (Operation, ["id", "task", "created_at"]),
    (Receipt, ["received_at", "machine", "kind", "event_id", "task"]),
    (OutboxMessage, ["created_at", "machine", "kind", "acked_at", "deliveries"]),
    (Lease, ["id", "task", "granted_at", "expires_at", "ended_at", "refused_reason"]),
    (IdempotencyRecord, ["owner", "key", "response_status", "created_at"]),
]:
    admin.site.register(model, list_display=fields)
