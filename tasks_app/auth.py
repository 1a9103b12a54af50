"""Authentication of machines (``Authorization: Machine <token>``) and of a task's
approval credential (``Authorization: Task <credential>``, Q5), and the permissions that
keep owner, machine and task-credential endpoints apart (K1, K2, Q7)."""
import hashlib
from dataclasses import dataclass

from rest_framework import authentication, permissions

from core.errors import ApplicationError
from tasks_app.models import FINAL_STATES, Machine, Task


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


@dataclass(frozen=True)
class TaskCredential:
    """What a request authenticated with a task's approval credential may act for: that
    task (``request.auth``; ``request.user`` is the task's owner)."""

    task: Task


class TaskCredentialAuthentication(authentication.BaseAuthentication):
    """``Authorization: Task <credential>`` -> (owner, TaskCredential) (Q5). The
    credential is issued with the task's lease and stored as a SHA-256 digest on the task;
    an unknown one, or one of a task that is final, answers 401 ``token_revoked``. It
    reaches only the approval endpoints that allow it (``IsOwnerOrTaskCredential``);
    everything else answers 403 (Q7)."""

    keyword = "Task"

    def authenticate(self, request):
        header = authentication.get_authorization_header(request).decode("latin-1").split()
        if not header or header[0] != self.keyword:
            return None
        task = None
        if len(header) == 2:
            task = Task.objects.select_related("owner").filter(approval_token_hash=token_digest(header[1])).first()
        if task is None:
            raise ApplicationError("token_revoked", "unknown task credential", status_code=401)
        if task.state in FINAL_STATES:
            raise ApplicationError("token_revoked", "the task is final: its credential no longer works", status_code=401)
        return (task.owner, TaskCredential(task))

    def authenticate_header(self, request):
        return self.keyword


def request_machine(request):
    """The Machine a request authenticated as, or None for an owner."""
    return request.auth if isinstance(request.auth, Machine) else None


def request_task_credential(request) -> TaskCredential | None:
    """The task credential a request authenticated with (Q5), or None."""
    return request.auth if isinstance(request.auth, TaskCredential) else None


def _is_owner(request) -> bool:
    return bool(
        request.user and request.user.is_authenticated and request_machine(request) is None
        and request_task_credential(request) is None
    )


class IsOwner(permissions.BasePermission):
    """An owner (token or browser session), never a machine token or a task credential."""

    def has_permission(self, request, view):
        return _is_owner(request)


class IsOwnerOrTaskCredential(permissions.BasePermission):
    """An owner, or a task's approval credential (Q5: its own task's approvals only, which
    the view enforces); never a machine token."""

    def has_permission(self, request, view):
        return _is_owner(request) or request_task_credential(request) is not None


class IsMachine(permissions.BasePermission):
    """A paired machine's token."""

    def has_permission(self, request, view):
        return request_machine(request) is not None


class IsOwnerOrMachine(permissions.BasePermission):
    """An owner or a paired machine's token; never a task credential."""

    def has_permission(self, request, view):
        return _is_owner(request) or request_machine(request) is not None
