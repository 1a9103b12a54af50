from django.apps import AppConfig


class SessionsAppConfig(AppConfig):
    name = "sessions_app"
    verbose_name = "Sessions"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        """Connect every receiver of the task seam (``tasks_app/signals.py``, S1, N1, Q5),
        all listed in ``sessions_app/receivers.py``. Imported here, not at module top,
        because it imports models and Django imports this module before the app registry
        is ready."""
        from sessions_app import receivers

        receivers.connect()
