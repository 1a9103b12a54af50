from django.apps import AppConfig


class NotificationsConfig(AppConfig):
    """N1-N3. Task transitions reach this app through the task core's seam, inside their
    transaction; its receiver is connected with the others in ``sessions_app/receivers.py``
    (tasks_app never imports this app)."""

    name = "notifications"
    label = "notifications"
    default_auto_field = "django.db.models.BigAutoField"
    verbose_name = "Notifications"
