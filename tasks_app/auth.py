"""Authentication of machines (``Authorization: Machine <token>``) and the permissions
that keep owner and machine endpoints apart (K1, K2)."""
import hashlib

from rest_framework import authentication, permissions

from config.errors import ApplicationError
from tasks_app.models import Machine


def token_digest(token: str) -> str:
    """SHA-256 hex digest under which machine tokens are stored."""
    return hashlib.sha256(token.encode()).hexdigest()


class TokenRevoked(ApplicationError):
    status_code = 401

    def __init__(self):
        super().__init__("token_revoked", "machine token revoked or unknown: pair the worker again")


class MachineAuthentication(authentication.BaseAuthentication):
    """``Authorization: Machine <token>`` -> (owner, machine). Any token that is not the
    current token of a paired machine answers 401 ``token_revoked`` (K1, R3)."""

    keyword = "Machine"

    def authenticate(self, request):
        header = authentication.get_authorization_header(request).decode("latin-1").split()
        if not header or header[0] != self.keyword:
            return None
        if len(header) != 2:
            raise TokenRevoked()
        machine = (
            Machine.objects.select_related("owner")
            .filter(token_hash=token_digest(header[1]), paired=True)
            .first()
        )
        if machine is None:
            raise TokenRevoked()
        return (machine.owner, machine)

    def authenticate_header(self, request):
        return self.keyword


def request_machine(request):
    """The Machine a request authenticated as, or None for an owner."""
    return request.auth if isinstance(request.auth, Machine) else None


class IsOwner(permissions.BasePermission):
    """An owner (token or browser session), never a machine token."""

    def has_permission(self, request, view):
        return bool(request.user and request.user.is_authenticated and request_machine(request) is None)


class IsMachine(permissions.BasePermission):
    """A paired machine's token."""

    def has_permission(self, request, view):
        return request_machine(request) is not None


class IsOwnerOrMachine(permissions.BasePermission):
    def has_permission(self, request, view):
        return bool(request.user and request.user.is_authenticated)
