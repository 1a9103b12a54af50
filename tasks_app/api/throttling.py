"""The task API's rate limits (K3): acceptances per owner, machine calls per machine.
Rates come from settings through ``core.throttling.SettingsRateThrottle``."""
from core.throttling import SettingsRateThrottle
from tasks_app.auth import request_machine


class OwnerAcceptRate(SettingsRateThrottle):
    """Acceptances (``POST /api/tasks/``) per owner: ``RUNSTEAD_ACCEPT_RATE``."""

    scope = "accept"
    rate_setting = "RUNSTEAD_ACCEPT_RATE"

    def get_cache_key(self, request, view):
        return f"runstead:rate:{self.scope}:owner:{request.user.pk}"


class MachineRate(SettingsRateThrottle):
    """Calls of one machine token to an endpoint family (``scope``) per machine."""

    def get_cache_key(self, request, view):
        machine = request_machine(request)
        return f"runstead:rate:{self.scope}:machine:{machine.pk}" if machine else None


class MachineProgressRate(MachineRate):
    """Progress reports (``POST /api/worker/progress/``, G4) per machine:
    ``RUNSTEAD_PROGRESS_RATE``."""

    scope = "progress"
    rate_setting = "RUNSTEAD_PROGRESS_RATE"
