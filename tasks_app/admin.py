"""Django admin: tasks with owner decisions on ``unknown`` ones (U3, U4); history shown
and never edited, owner changes only through actions that call the API's services (U5)."""
from django.contrib import admin, messages
from django.db.models import Case, IntegerField, Value, When

from core import clock
from core.admin_history import HistoryAdmin, HistoryInline, OwnerScopedAdmin
from core.errors import ApplicationError
from tasks_app.agent_facts import describe_git
from tasks_app.models import (
    Budget, Grant, IdempotencyRecord, Lease, Machine, Operation, OutboxMessage, PairingAttempt, PairingCode, Receipt,
    Task, TaskEvent, TaskState,
)
from tasks_app.services.decisions import task_ask_again, task_clear_survivor_lock, task_decide
from tasks_app.services.pairing import pairing_code_create
from tasks_app.services.revocation import grant_revoke, machine_unpair


def _actor(request) -> str:
    """The actor recorded for an admin action: the same string the API records (U3, U5)."""
    return f"owner:{request.user.get_username()}"


class EvidenceInline(HistoryInline):
    """Read-only history rows under a task (U4). Whoever may view the task sees them, without
    separate permissions on these models; nobody adds, edits or deletes them (append-only)."""

    def has_view_permission(self, request, obj=None):
        return request.user.has_perm("tasks_app.view_task") or request.user.has_perm("tasks_app.change_task")


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
class TaskAdmin(OwnerScopedAdmin):
    """Unknown tasks first, with their evidence (U4); decisions as actions (U3). Every field
    is read-only (``state`` moves only through the services) and no task is added or
    deleted here: deleting one would delete its lease and receipts (L1, U5)."""

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
    readonly_fields = ["git_evidence", *[f.name for f in Task._meta.fields]]

    @admin.display(description="git evidence (G5)")
    def git_evidence(self, obj):
        """U4: "2 commits, 5 files changed since the task started (+10 -3)"."""
        return describe_git((obj.evidence or {}).get("git"))

    def get_ordering(self, request):
        # Unknown tasks first (U3). The changelist takes its ordering from here, not from
        # the queryset (it would fall back to Task.Meta.ordering).
        unknown_first = Case(When(state=TaskState.UNKNOWN, then=Value(0)), default=Value(1), output_field=IntegerField())
        return [unknown_first.asc(), "-created_at"]

    def has_add_permission(self, request):
        return False

    def has_delete_permission(self, request, obj=None):
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
class MachineAdmin(OwnerScopedAdmin):
    """Machines (U5, K1, P1, P3): only ``name`` is editable; ``paired``, ``generation`` and
    the token digest change only through pairing and the actions below, which call the
    same services as ``POST /api/machines/{id}/unpair/`` and
    ``POST /api/machines/pairing-codes/``. Machines are added by pairing, never here."""

    list_display = ["name", "owner", "generation", "paired", "unpaired_at", "last_heard_at", "created_at"]
    list_filter = ["paired"]
    search_fields = ["name"]
    actions = ["unpair", "re_pair"]

    def get_readonly_fields(self, request, obj=None):
        return [f.name for f in Machine._meta.concrete_fields if f.name != "name"]

    def has_add_permission(self, request):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

    def has_pairing_permission(self, request):
        return request.user.has_perm("tasks_app.change_machine")

    @admin.action(description="Unpair (P3: waiting tasks not_started, running work stops)", permissions=["pairing"])
    def unpair(self, request, queryset):
        now = clock.now()
        for machine in queryset.order_by("pk"):
            machine = machine_unpair(machine=machine, actor=_actor(request), now=now)
            self.message_user(request, f"Unpaired {machine.name}")

    @admin.action(description="Re-pair (shows a one-time pairing code)", permissions=["pairing"])
    def re_pair(self, request, queryset):
        now = clock.now()
        for machine in queryset.order_by("pk"):
            code, row = pairing_code_create(owner=machine.owner, machine_id=machine.pk, now=now)
            self.message_user(
                request,
                f"Pairing code for {machine.name}: {code} (single use, expires {row.expires_at.isoformat()}; shown once, "
                "only its digest is kept: run `manage.py pair_worker --code ...` on the machine)",
            )


@admin.register(Grant)
class GrantAdmin(OwnerScopedAdmin):
    """Grants (U5, P1, P3): shown, never edited or deleted here (a changed path or a cleared
    ``revoked_at`` would skip P1/P3); revoked through the action, which calls the same
    service as ``POST /api/grants/{id}/revoke/``. Grants are created through the API."""

    list_display = ["path", "machine", "owner", "created_at", "revoked_at"]
    list_filter = ["revoked_at"]
    search_fields = ["path"]
    actions = ["revoke"]

    def get_readonly_fields(self, request, obj=None):
        return [f.name for f in Grant._meta.concrete_fields]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

    def has_revoke_permission(self, request):
        return request.user.has_perm("tasks_app.change_grant")

    @admin.action(description="Revoke (P3: waiting tasks not_started, running work stops)", permissions=["revoke"])
    def revoke(self, request, queryset):
        now = clock.now()
        for grant in queryset.order_by("pk"):
            grant = grant_revoke(grant=grant, actor=_actor(request), now=now)
            self.message_user(request, f"Revoked the grant of {grant.path}")


@admin.register(Budget)
class BudgetAdmin(OwnerScopedAdmin):
    """The owner's limit is editable; what is reserved and spent moves only with tasks."""

    list_display = ["owner", "limit_s", "reserved_s", "spent_s"]

    def get_readonly_fields(self, request, obj=None):
        return ["reserved_s", "spent_s"] + (["owner"] if obj is not None else [])

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(Operation)
class OperationAdmin(HistoryAdmin):
    owner_lookup = "task__owner"
    list_display = ["id", "task", "created_at"]


@admin.register(Receipt)
class ReceiptAdmin(HistoryAdmin):
    owner_lookup = "machine__owner"
    list_display = ["received_at", "machine", "kind", "event_id", "generation", "task", "response_status"]
    list_filter = ["kind"]


@admin.register(OutboxMessage)
class OutboxMessageAdmin(HistoryAdmin):
    owner_lookup = "machine__owner"
    list_display = ["created_at", "machine", "kind", "operation", "visible_at", "deliveries", "acked_at"]
    list_filter = ["kind"]


@admin.register(Lease)
class LeaseAdmin(HistoryAdmin):
    owner_lookup = "task__owner"
    list_display = ["id", "task", "generation", "granted_at", "renewals", "expires_at", "ended_at", "end_reason",
                    "refused_reason"]


@admin.register(TaskEvent)
class TaskEventAdmin(HistoryAdmin):
    owner_lookup = "task__owner"
    list_display = ["at", "task", "old_state", "new_state", "reason", "actor"]


@admin.register(IdempotencyRecord)
class IdempotencyRecordAdmin(HistoryAdmin):
    list_display = ["owner", "key", "response_status", "task", "created_at"]


@admin.register(PairingCode)
class PairingCodeAdmin(HistoryAdmin):
    """Codes are made by the re-pair action or the API; only their digests are stored."""

    list_display = ["owner", "machine", "name", "created_at", "expires_at", "used_at", "attempts"]


@admin.register(PairingAttempt)
class PairingAttemptAdmin(HistoryAdmin):
    owner_lookup = None  # attempts belong to a client address, not to an owner
    list_display = ["at", "client", "ok"]
