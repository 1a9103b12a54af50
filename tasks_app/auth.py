"""Authentication of machines (``Authorization: Machine <token>``) and of a task's
approval credential (``Authorization: Task <credential>``, Q5), and the permissions that
keep owner, machine and task-credential endpoints apart (K1, K2, Q7)."""
import copy
import hashlib
import logging
import threading
import time
from dataclasses import dataclass

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import transaction
from rest_framework import authentication, exceptions, permissions

from core import epoch
from core.errors import ApplicationError
from tasks_app.models import FINAL_STATES, Machine, Task

POSTGRESQL = "django.db.backends.postgresql"

log = logging.getLogger("runstead.auth")


def token_digest(token: str) -> str:
    """SHA-256 hex digest under which machine tokens are stored."""
    return hashlib.sha256(token.encode()).hexdigest()


class TokenRevoked(ApplicationError):
    status_code = 401

    def __init__(self):
        super().__init__("token_revoked", "machine token revoked or unknown: pair the worker again")


class MachineAuthentication(authentication.BaseAuthentication):
    """``Authorization: Machine <token>`` -> (owner, machine). Any token that is not the
    current token of a paired machine answers 401 ``token_revoked`` (K1, R3). A view
    with ``machine_token_cached = True`` (the worker's pull, which every idle worker
    starts every ~25 s, and its renewals and syncs, which every busy one sends once per
    renewal interval) looks the token up through this process's ``MachineTokenCache``."""

    keyword = "Machine"

    def authenticate(self, request):
        digest = machine_token_digest(authentication.get_authorization_header(request))
        if digest is None:
            return None
        view = (getattr(request, "parser_context", None) or {}).get("view")
        return machine_tokens.lookup(digest) if getattr(view, "machine_token_cached", False) else paired_machine(digest)

    def authenticate_header(self, request):
        return self.keyword


def machine_token_digest(authorization: bytes) -> str | None:
    """The digest of the token of an ``Authorization: Machine <token>`` header's value;
    None for another scheme or none; ``TokenRevoked`` for a malformed one."""
    words = authorization.decode("latin-1").split()
    if not words or words[0] != MachineAuthentication.keyword:
        return None
    if len(words) != 2:
        raise TokenRevoked()
    return token_digest(words[1])


def paired_machine(digest: str):
    """(owner, machine) of the paired machine whose token has ``digest``, read from the
    database; raises ``TokenRevoked`` for any other token."""
    machine = Machine.objects.select_related("owner").filter(token_hash=digest, paired=True).first()
    if machine is None:
        raise TokenRevoked()
    return (machine.owner, machine)


class EpochCache:
    """A per-process cache of credentials (K1) that another process can invalidate: its
    entries hold while the shared counter ``NAME`` (``core.epoch``) stays where it was
    when they were read. The counter is read again when the last read is older than
    ``RUNSTEAD_TOKEN_EPOCH_FRESH_S`` (0.25 s: 40 starts a second share about four reads);
    when it moved, every entry is forgotten. Without Redis, when Redis does not answer,
    or on a database other than PostgreSQL, nothing is cached. At most ``MAX_ENTRIES``.
    Subclasses read their rows (``_read``) with a lock that waits for the transaction
    that invalidates them, which bumps the counter after locking the row."""

    NAME = ""
    MAX_ENTRIES = 100_000

    def __init__(self):
        self._lock = threading.Lock()
        self._epoch = None
        self._epoch_read_at = 0.0  # time.monotonic() of the read that gave ``_epoch``
        self._entries: dict = {}

    def _current_epoch(self) -> int | None:
        """The shared counter, read again when the last read is older than
        ``RUNSTEAD_TOKEN_EPOCH_FRESH_S`` seconds; None: do not cache."""
        if not self.enabled():
            return None
        now = time.monotonic()
        with self._lock:
            if self._fresh(now):
                return self._epoch
        current = epoch.read(self.NAME)
        if current is not None:
            with self._lock:
                if current != self._epoch:
                    self._entries.clear()
                    self._epoch = current
                self._epoch_read_at = now
        return current

    @staticmethod
    def enabled() -> bool:
        """Whether this deployment caches at all: PostgreSQL and a shared counter (Redis).
        From the settings, not the connection (the event loop asks it at every start)."""
        return bool(settings.REDIS_URL) and settings.DATABASES["default"]["ENGINE"] == POSTGRESQL

    def _fresh(self, now: float) -> bool:
        """The counter was read less than ``RUNSTEAD_TOKEN_EPOCH_FRESH_S`` before ``now``
        (``time.monotonic()``). Under ``_lock``."""
        return self._epoch is not None and now - self._epoch_read_at < settings.RUNSTEAD_TOKEN_EPOCH_FRESH_S

    def _missing(self, keys, current: int) -> list:
        """Those of ``keys`` not cached under the counter ``current``, sorted."""
        with self._lock:
            return sorted({k for k in keys if k not in self._entries or current != self._epoch})

    def _store(self, found: dict, current: int) -> None:
        """Cache ``found`` under the counter ``current`` if it is still this process's."""
        with self._lock:
            if self._epoch == current:
                for key, hit in found.items():
                    if len(self._entries) >= self.MAX_ENTRIES:
                        break
                    self._entries[key] = hit

    def _cached(self, key):
        """The entry of ``key`` without any I/O, only while the counter is fresh; None
        otherwise or when not cached."""
        now = time.monotonic()
        with self._lock:
            return self._entries.get(key) if self._fresh(now) else None

    def forget(self) -> None:
        """Drop every entry of this process (an invalidation here; tests between cases)."""
        with self._lock:
            self._entries.clear()
            self._epoch = None

    def changed(self, what: str) -> None:
        """K1: call inside the transaction that invalidates entries (``what`` names it in
        the log and the refusal), after it locked the rows it changes: every process
        forgets its entries. Raises ApplicationError 503 ``service_unavailable`` when Redis
        is configured and does not answer (the transaction then changes nothing: a change
        the other processes might not see is not made)."""
        try:
            epoch.bump(self.NAME)
        except epoch.EpochUnavailable as exc:
            log.error("%s: the %s is refused", exc, what)
            raise ApplicationError("service_unavailable", f"the service cannot tell its other processes of the "
                                   f"{what} now (Redis): try again", status_code=503) from exc
        finally:
            # After the bump: no lookup here can read the old counter again and trust it
            # (fresh for RUNSTEAD_TOKEN_EPOCH_FRESH_S) with an entry cached under it.
            self.forget()


class MachineTokenCache(EpochCache):
    """This process's machine tokens (digest -> owner, machine) for the worker's pull
    start, which every idle worker makes every ~25 s (D1; issue 22: a pull start without
    a token read). K1 holds as without it (``EpochCache``):

    - ``machine_tokens_changed`` moves the counter inside the transaction that revokes or
      re-pairs, after that transaction locked the machine's row ``FOR UPDATE``;
    - a miss reads the row ``FOR KEY SHARE`` (one statement, its own transaction), which
      waits for such a transaction to end, so a token is never cached from before a
      revocation under the counter after it.

    So a revoked or re-paired token is refused by the revoking process from the
    revocation's commit on, and by every other one within ``RUNSTEAD_TOKEN_EPOCH_FRESH_S``
    of it. The machine of an entry is shared by this process's pulls: read-only but
    for ``last_heard_at``, which ``pairing.machines_heard`` keeps current; the owner is a
    copy."""

    NAME = "machine-tokens"

    def lookup(self, digest: str):
        """(owner, machine) of the paired machine whose token has ``digest``; raises
        ``TokenRevoked`` for any other."""
        current = self._current_epoch()
        if current is None:
            return paired_machine(digest)
        with self._lock:
            hit = self._entries.get(digest) if current == self._epoch else None
        if hit is None:
            hit = self._read([digest], current).get(digest)
            if hit is None:
                raise TokenRevoked()
        return copy.copy(hit[0]), hit[1]

    def warm(self, digests: list[str]) -> None:
        """Read the counter (when not fresh) and the paired machines of those of
        ``digests`` not cached, in ONE statement, as ``lookup`` reads one: a batch of
        pull starts (the long-poll fast path, ``core.longpoll``). Unknown digests stay uncached (their
        ``lookup`` refuses them)."""
        current = self._current_epoch()
        if current is None:
            return
        if missing := self._missing(digests, current):
            self._read(missing, current)

    def _read(self, digests: list[str], current: int) -> dict[str, tuple]:
        """digest -> (owner, machine) of the paired machines of ``digests``, read ``FOR KEY
        SHARE`` (one statement, its own transaction: it waits for a revocation of one of
        them to end) and cached under the counter ``current`` if it is still this
        process's."""
        log.debug("machine token cache: %d missed", len(digests))
        sql, params = Machine.objects.filter(token_hash__in=digests, paired=True).query.sql_with_params()
        machines = list(Machine.objects.raw(f"{sql} FOR KEY SHARE", params))
        owners = get_user_model().objects.in_bulk({m.owner_id for m in machines})
        found = {m.token_hash: (owners[m.owner_id], m) for m in machines if m.owner_id in owners}
        self._store(found, current)
        return found

    def key(self, authorization: bytes, kwargs: dict | None = None) -> str | None:
        """The long-poll fast path's parse of a raw ``Authorization`` header value
        (``core.longpoll.QuickAuth``; the worker's pull, whose path has no parameters):
        the token's digest, by ``machine_token_digest`` as ``MachineAuthentication``
        parses it, when this process caches tokens (``enabled``); None for another
        scheme, a malformed value (the view answers it ``token_revoked``) or no caching."""
        if not self.enabled():
            return None
        try:
            return machine_token_digest(authorization)
        except TokenRevoked:
            return None

    def cached(self, digest: str) -> Machine | None:
        """The machine of ``digest`` from this process alone, without any I/O (the pull's
        fast path on the event loop, ``core.longpoll``), shared as
        ``lookup``'s: only while the counter was read less than
        ``RUNSTEAD_TOKEN_EPOCH_FRESH_S`` ago, as ``lookup`` would use it; None otherwise,
        or for a digest not cached (then ``lookup``)."""
        hit = self._cached(digest)
        return None if hit is None else hit[1]


machine_tokens = MachineTokenCache()


def machine_tokens_changed() -> None:
    """K1: call inside the transaction that revokes a machine token or re-pairs a machine,
    after it locked the machine's row ``FOR UPDATE`` (``EpochCache.changed``)."""
    machine_tokens.changed("revocation")


def owner_token_key(authorization: bytes) -> str | None:
    """The key of an ``Authorization: Token <key>`` header's value, parsed as DRF's
    ``TokenAuthentication`` parses it (the keyword in any case); None for another scheme
    or none; DRF's ``AuthenticationFailed`` for a malformed one. The one parser of owner
    tokens: ``OwnerTokenAuthentication`` and the approval long-poll's fast path."""
    words = authorization.split()
    if not words or words[0].lower() != OwnerTokenAuthentication.keyword.lower().encode():
        return None
    if len(words) == 1:
        raise exceptions.AuthenticationFailed("Invalid token header. No credentials provided.")
    if len(words) > 2:
        raise exceptions.AuthenticationFailed("Invalid token header. Token string should not contain spaces.")
    try:
        return words[1].decode()
    except UnicodeError:
        raise exceptions.AuthenticationFailed("Invalid token header. "
                                              "Token string should not contain invalid characters.") from None


class OwnerTokenAuthentication(authentication.TokenAuthentication):
    """DRF's ``TokenAuthentication`` (``Authorization: Token <key>``, an active owner)
    with its header parsed by ``owner_token_key``."""

    def authenticate(self, request):
        key = owner_token_key(authentication.get_authorization_header(request))
        return None if key is None else self.authenticate_credentials(key)


class OwnerTokenCache(EpochCache):
    """This process's owner API tokens (key -> the active owner) for the approval hook's
    long-poll start, which every waiting ``PermissionRequest`` hook makes every ~25 s
    (issue 44: 1,000 waiting hooks as cheap as 1,000 waiting workers). K1 holds as
    without it (``EpochCache``): ``owner_tokens_changed`` moves the counter when a token
    is deleted (``POST /api/token/rotate/``, an owner deleted) or an owner changed (made
    inactive), inside that transaction; a miss reads the tokens ``FOR KEY SHARE`` and
    their owners ``FOR SHARE`` (one transaction), which waits for such a transaction to
    end. So a rotated token is refused by the rotating process from the commit on, and
    by every other one within ``RUNSTEAD_TOKEN_EPOCH_FRESH_S``."""

    NAME = "owner-tokens"

    def warm(self, keys: list[str]) -> None:
        """Read the counter (when not fresh) and the tokens of ``keys`` not cached, with
        their owners, in one transaction. Unknown keys and inactive owners stay uncached."""
        current = self._current_epoch()
        if current is None:
            return
        if missing := self._missing(keys, current):
            log.debug("owner token cache: %d missed", len(missing))
            from rest_framework.authtoken.models import Token

            user_model = get_user_model()
            with transaction.atomic():
                sql, params = Token.objects.filter(key__in=missing).query.sql_with_params()
                tokens = list(Token.objects.raw(f"{sql} FOR KEY SHARE", params))
                sql, params = user_model.objects.filter(pk__in={t.user_id for t in tokens},
                                                        is_active=True).query.sql_with_params()
                owners = {u.pk: u for u in user_model.objects.raw(f"{sql} FOR SHARE", params)}
            self._store({t.key: owners[t.user_id] for t in tokens if t.user_id in owners}, current)

    def key(self, authorization: bytes) -> str | None:
        """The token key of a raw ``Authorization`` header value (``owner_token_key``)
        when this process caches tokens; None otherwise, for another scheme, or for a
        malformed one (the view answers it)."""
        if not self.enabled():
            return None
        try:
            return owner_token_key(authorization)
        except exceptions.AuthenticationFailed:
            return None

    def cached(self, key: str):
        """The active owner of token ``key`` from this process alone, without I/O, while
        the counter is fresh; None otherwise or when not cached."""
        return self._cached(key)


owner_tokens = OwnerTokenCache()


def owner_tokens_changed() -> None:
    """K1: call inside the transaction that deletes an owner's token or changes an owner
    (``tasks_app.apps``' signals; ``EpochCache.changed``)."""
    owner_tokens.changed("change of an owner's token")


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
