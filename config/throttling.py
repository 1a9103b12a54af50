"""Rate limits as a brake (K1, K3): DRF throttles keyed by owner or by machine, with their
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


class OwnerAcceptRate(SettingsRateThrottle):
    """Acceptances (``POST /api/tasks/``) per owner: ``RUNSTEAD_ACCEPT_RATE``."""

    scope = "accept"
    rate_setting = "RUNSTEAD_ACCEPT_RATE"

    def get_cache_key(self, request, view):
        return f"runstead:rate:{self.scope}:owner:{request.user.pk}"


class MachineRate(SettingsRateThrottle):
    """Calls of one machine token to an endpoint family (``scope``) per machine."""

    def get_cache_key(self, request, view):
        from tasks_app.auth import request_machine

        machine = request_machine(request)
        return f"runstead:rate:{self.scope}:machine:{machine.pk}" if machine else None


class MachineProgressRate(MachineRate):
    """Progress reports (``POST /api/worker/progress/``, G4) per machine:
    ``RUNSTEAD_PROGRESS_RATE``."""

    scope = "progress"
    rate_setting = "RUNSTEAD_PROGRESS_RATE"
