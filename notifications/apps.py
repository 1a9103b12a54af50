from django.apps import AppConfig

from tasks_app.signals import task_changed


class NotificationsConfig(AppConfig):
    name = "notifications"
    label = "notifications"
    default_auto_field = "django.db.models.BigAutoField"
    verbose_name = "Notifications"

    def ready(self):
        # N1: task transitions reach us through the task core's seam, inside their
        # transaction (tasks_app never imports this app).
        task_changed.connect(_on_task_changed, dispatch_uid="notifications.task_changed")


def _on_task_changed(sender, task, now, **kwargs):
    # Imported here: services import models, and Django imports this module before the
    # app registry is ready.
    from notifications.services import notify_task_state

    notify_task_state(task, now=now)
