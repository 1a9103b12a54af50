"""Chat sessions, their running markers and background jobs (SPEC M, S)."""
import uuid

from django.conf import settings
from django.db import models


class SessionStatus(models.TextChoices):
    BUSY = "busy"
    IDLE = "idle"


class Session(models.Model):
    """A chat session. ``status`` is stored and changed only by compare-and-set (S2)."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="chat_sessions")
    title = models.CharField(max_length=300, blank=True)
    status = models.CharField(max_length=10, choices=SessionStatus.choices, default=SessionStatus.IDLE)
    status_since = models.DateTimeField()
    created_at = models.DateTimeField()
    version = models.PositiveBigIntegerField(default=1)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self):
        return self.title or str(self.id)
