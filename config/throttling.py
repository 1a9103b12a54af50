"""Rate limits as a brake (K1, K3): DRF throttles (the apps key them by owner or machine,
e.g. tasks_app/api/throttling.py), with their
rates read from settings on every request (so tests and operators set them through the
environment), answering 429 ``{"error": "rate_limited", "detail", "retry_after_s"}`` with
a ``Retry-After`` header (seconds) through ``config.exception_handler``.

They count in Django's cache (per process with the default local-memory cache), which is
a brake against a runaway client, not a security boundary (FACTS: DRF throttling).
"""
from django.conf import settings
from rest_framework.throttling import SimpleRateThrottle


class SettingsRateThrottle(SimpleRateThrottle):
    """A DRF ``SimpleRateThrottle`` whose rate (``"N/period"``, period ``s``, ``min``,
    ``hour`` or ``day``) is the Django setting named ``rate_setting``, read per request."""

    rate_setting = ""

    def get_rate(self):
        return getattr(settings, self.rate_setting)
