from django.apps import AppConfig

from tasks_app.signals import task_changed, task_session_claimed


class SessionsAppConfig(AppConfig):
    name = "sessions_app"
    verbose_name = "Sessions"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        """Connect the sessions app to the task seam (``tasks_app/signals.py``, S1).
        ``receivers`` is imported here, not at module top, because it imports models and
        Django imports this module before the app registry is ready."""
        from sessions_app import receivers

        task_changed.connect(receivers.on_task_changed, dispatch_uid="sessions-s1-refresh")
        task_session_claimed.connect(receivers.on_task_session_claimed, dispatch_uid="sessions-claim")
