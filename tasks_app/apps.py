from django.apps import AppConfig
from django.conf import settings
from django.db.models.signals import post_delete, post_save


def _give_new_owner_a_budget(sender, instance, created, raw=False, **kwargs):
    """A new owner starts with RUNSTEAD_DEFAULT_BUDGET_S seconds (glossary, "budget")."""
    if created and not raw:
        # Imported here: Django imports this module before the app registry is ready.
        from tasks_app.models import Budget

        Budget.objects.get_or_create(owner=instance, defaults={"limit_s": settings.RUNSTEAD_DEFAULT_BUDGET_S})


def _forget_deleted_machines_token(sender, instance, **kwargs):
    """K1: a deleted machine (its owner deleted) is forgotten by every process's token
    cache, as an unpaired one is (``tasks_app.auth.machine_tokens_changed``)."""
    from tasks_app.auth import machine_tokens_changed

    if instance.paired:
        machine_tokens_changed()


def _forget_owner_tokens_on_delete(sender, instance, **kwargs):
    """K1: a deleted owner token (rotated, its owner deleted) is forgotten by every
    process's owner-token cache (``tasks_app.auth.owner_tokens_changed``)."""
    from tasks_app.auth import owner_tokens_changed

    owner_tokens_changed()


def _forget_owner_tokens_on_change(sender, instance, created, update_fields=None, raw=False, **kwargs):
    """K1: an owner changed (made inactive, say) is read again by every process's
    owner-token cache; a new owner has nothing cached, and a login's ``last_login``
    changes nothing a token decides."""
    from tasks_app.auth import owner_tokens_changed

    if not created and not raw and set(update_fields or ()) != {"last_login"}:
        owner_tokens_changed()


class TasksAppConfig(AppConfig):
    name = "tasks_app"
    verbose_name = "Tasks"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        from tasks_app import schema  # noqa: F401 - registers the OpenAPI auth extension

        post_save.connect(_give_new_owner_a_budget, sender=settings.AUTH_USER_MODEL, dispatch_uid="runstead-budget")
        post_delete.connect(_forget_deleted_machines_token, sender="tasks_app.Machine", dispatch_uid="runstead-tokens")
        post_delete.connect(_forget_owner_tokens_on_delete, sender="authtoken.Token", dispatch_uid="runstead-owner-tokens")
        post_save.connect(_forget_owner_tokens_on_change, sender=settings.AUTH_USER_MODEL,
                          dispatch_uid="runstead-owner-changed")
