"""Django admin building blocks shared by both apps (SPEC U5: the admin shows history and
edits none of it).

``HistoryAdmin`` is a read-only ModelAdmin: its changelist and change page show every
field, and nobody (superusers included) may add, change or delete a row through the
admin; a POST to its add, change or delete URL answers 403. ``OwnerScopedAdmin`` limits
what a non-superuser staff member sees to rows they own (K2), through ``owner_lookup``.
"""
from django.contrib import admin
from django.http import Http404


class NoWrites:
    """Nobody (superusers included) adds, changes or deletes through this admin (U5)."""

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


class OwnerScopedAdmin(admin.ModelAdmin):
    """Non-superusers see only their own rows: ``owner_lookup`` is the ORM path from the
    model to its owner (``"owner"``, ``"task__owner"``, ...); None shows them nothing."""

    owner_lookup: str | None = "owner"

    def get_queryset(self, request):
        qs = super().get_queryset(request)
        if request.user.is_superuser:
            return qs
        if self.owner_lookup is None:
            return qs.none()
        return qs.filter(**{self.owner_lookup: request.user})

    def get_object(self, request, object_id, from_field=None):
        """Another owner's id (or no such id) answers 404 as everywhere else (K2), not
        Django's redirect to the admin index with a "does not exist" message."""
        obj = super().get_object(request, object_id, from_field)
        if obj is None:
            raise Http404("no such object")
        return obj


class HistoryAdmin(NoWrites, OwnerScopedAdmin):
    """History rows (U5): listed and shown with every field, never added, changed or
    deleted here. ``list_display`` defaults to every concrete field."""

    def get_list_display(self, request):
        if self.list_display != ("__str__",):
            return self.list_display
        return [f.name for f in self.model._meta.concrete_fields]

    def get_readonly_fields(self, request, obj=None):
        return [f.name for f in self.model._meta.concrete_fields]


class HistoryInline(NoWrites, admin.TabularInline):
    """History rows under their parent (U4, U5): shown, never added, changed or deleted."""

    extra = 0
    can_delete = False

    def get_readonly_fields(self, request, obj=None):
        return self.fields or [f.name for f in self.model._meta.concrete_fields]
