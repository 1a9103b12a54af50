from django.apps import AppConfig
from django.conf import settings
from django.db.models.signals import post_save


def _give_new_owner_a_budget(sender, instance, created, raw=False, **kwargs):
    """A new owner starts with RUNSTEAD_DEFAULT_BUDGET_S seconds (glossary, "budget")."""
    if created and not raw:
        # Imported here: Django imports this module before the app registry is ready.
        from tasks_app.models import Budget

        Budget.objects.get_or_create(owner=instance, defaults={"limit_s": settings.RUNSTEAD_DEFAULT_BUDGET_S})


class TasksAppConfig(AppConfig):
    name = "tasks_app"
    verbose_name = "Tasks"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        from tasks_app import schema  # noqa: F401 - registers the OpenAPI auth extension

        post_save.connect(_give_new_owner_a_budget, sender=settings.AUTH_USER_MODEL, dispatch_uid="runstead-budget")
