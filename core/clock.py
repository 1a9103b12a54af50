"""The service clock: the one place the service reads the time (SPEC 1, "clock").

Read it once per operation and pass ``now`` down; tests pin it with time-machine.
Nothing uses the database server's ``now()``.
"""
from datetime import datetime

from django.utils import timezone


def now() -> datetime:
    """Current UTC time (aware)."""
    return timezone.now()
