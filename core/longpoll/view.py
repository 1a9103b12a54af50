"""What a long-poll view declares (``LongPoll``) and answers (``WaitResponse``), and the
fast path that answers a view's usual request on the event loop from those declarations
(``quick_start``, ``quick_key``/``quick_warm``). See ``README.md``."""
import functools
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from rest_framework.exceptions import ValidationError
from rest_framework.renderers import JSONRenderer
from rest_framework.response import Response

from core.longpoll.perform import take_or_wait_sync
from core.longpoll.registry import Wait

_JSON = JSONRenderer()
_JSON_ACCEPTS = (b"*/*", _JSON.media_type.encode())  # what the fast path's JSON answer satisfies


class QuickAuth(Protocol):
    """How the fast path authenticates a raw request on the event loop, without I/O
    (``tasks_app.auth.MachineTokenCache`` is one).

    - ``key(authorization: bytes, kwargs: dict) -> Hashable | None``: the credential of
      one ``Authorization`` header value, parsed by the same parser as the view's DRF
      authentication, with what it is for among the path's ``kwargs`` (the approval's
      id; the worker's pull has none) (None: not one this fast path vouches for; the
      view answers it);
    - ``cached(key) -> subject | None``: what it authenticates as, from this process
      alone (None: unknown here, or not to be trusted without a read);
    - ``warm(keys: list)``: read the credentials of a batch of starts at once (called in
      a pool thread; the next ``cached`` of each answers from it).
    """

    def key(self, authorization: bytes, kwargs: dict) -> Hashable | None: ...

    def cached(self, key) -> Any: ...

    def warm(self, keys: list) -> None: ...


@dataclass(frozen=True)
class LongPoll:
    """A long-poll view's declaration, as its class attribute ``long_poll`` (D1, D2, Q3):

    - ``wait(subject, wait_s) -> Wait``: what it waits for (the service's ``Wait``: key
      and take) for the authorised ``subject`` (a machine, an approval) and the asked
      ``?wait=`` seconds;
    - ``render(result) -> dict``: the JSON body of the wait's result (called in a thread:
      it may read the database, unless ``render_in_thread`` is False);
    - ``quick_auth``: how the fast path authenticates a raw request (``QuickAuth``);
      None: only the view's DRF authentication, through the view;
    - ``query``: the view's query serializer, whose ``wait`` field the fast path checks
      ``?wait=`` with (needed with ``quick_auth``);
    - ``keepalive``: whether the waiting response sends a space every
      ``RUNSTEAD_LONGPOLL_KEEPALIVE_S`` seconds, for a client that gives a request up by
      its silence (the worker's pull, D1); False for a client that bounds the whole
      request by its own timeout (the approval hook, Q3), to which the spaces say nothing
      (1,000 waiting hooks: 333 writes a second);
    - ``render_in_thread``: False for a ``render`` that reads only what the take loaded
      (the worker's pull): the router renders the answer on the event loop, without a
      thread (1,000 idle workers end about 40 pulls a second).

    The view's handler parses, authorises and returns ``long_poll.answer(subject, wait_s)``.
    """

    wait: Callable[[Any, float], Wait]
    render: Callable[[Any], dict]
    quick_auth: QuickAuth | None = None
    query: type | None = None
    keepalive: bool = True
    render_in_thread: bool = True

    def __post_init__(self):
        if self.quick_auth is not None and self.query is None:
            raise TypeError("a long-poll with quick_auth declares its query serializer (its ``wait`` field)")

    def answer(self, subject, wait_s: float) -> "WaitResponse":
        """The view's answer (status 200): the wait for ``subject`` of ``wait_s`` seconds,
        performed by the router (ASGI) or when rendered (WSGI)."""
        return WaitResponse(self.wait(subject, wait_s), self.render, keepalive=self.keepalive,
                            render_in_thread=self.render_in_thread)


class WaitResponse(Response):
    """A long-poll view's answer: ``wait`` (a ``Wait``) and ``render``, which turns the
    wait's result into the JSON body (a dict; called in a thread, so it may read the
    database, unless ``render_in_thread`` is False). Status 200 unless ``status`` says
    otherwise. Under ASGI the router performs the wait (``take_or_wait``), with keep-alive
    spaces if ``keepalive`` (``LongPoll``); anywhere else rendering the response performs
    it in the request's thread (``take_or_wait_sync``), outside the view's transaction."""

    def __init__(self, wait: Wait, render: Callable[[Any], dict], *, keepalive: bool = True,
                 render_in_thread: bool = True, **kwargs):
        super().__init__(None, **kwargs)
        self.wait = wait
        self.render_result = render
        self.keepalive = keepalive
        self.render_in_thread = render_in_thread
        self._waited = False

    def finish(self, result) -> "WaitResponse":
        """Render the body from the wait's ``result``."""
        self.data = self.render_result(result)
        self._waited = True
        return self.render()

    @property
    def rendered_content(self):
        if not self._waited:  # not performed by the router: wait here, in this thread
            self.data = self.render_result(take_or_wait_sync(self.wait))
            self._waited = True
        return super().rendered_content


# --- the fast path: a view's usual request on the event loop ----------------------------


def quick_start(view_class: type, scope: dict, kwargs: dict | None = None) -> WaitResponse | None:
    """What ``view_class`` would answer to ``scope`` (a raw ASGI ``GET``), made on the event
    loop with no I/O, no thread and no DRF dispatch (issue 22: 1,000 idle workers start 40
    pulls a second): only for the usual request (``_usual``) whose credential
    ``long_poll.quick_auth.cached`` knows. None for anything else: the view answers it,
    errors included. ``kwargs``: the path's (its ``ResolverMatch``'s)."""
    declared = getattr(view_class, "long_poll", None)
    usual = _usual(declared, scope, kwargs or {})
    subject = None if usual is None else declared.quick_auth.cached(usual[1])
    if subject is None:
        return None
    response = declared.answer(subject, usual[0])
    response.accepted_renderer, response.accepted_media_type = _JSON, _JSON.media_type
    response.renderer_context = {}
    response["Vary"] = "Accept"
    response["Allow"] = _allow(view_class)
    return response


def quick_key(view_class: type, scope: dict, kwargs: dict | None = None) -> Hashable | None:
    """The credential key of a usual request ``quick_start`` did not answer (not cached
    here), for one batched ``quick_warm``; None for any other request."""
    usual = _usual(getattr(view_class, "long_poll", None), scope, kwargs or {})
    return None if usual is None else usual[1]


def quick_warm(view_class: type, keys: Iterable) -> None:
    """``long_poll.quick_auth.warm(keys)``: one read for a batch of starts (a pool thread)."""
    view_class.long_poll.quick_auth.warm(list(keys))


def _usual(declared: LongPoll | None, scope: dict, kwargs: dict) -> tuple | None:
    """(wait in seconds, credential key) of a view's usual request: only ``?wait=S`` (S as
    the view's query serializer takes it), one ``Authorization`` that ``quick_auth.key``
    parses, and no ``Accept`` or one the JSON renderer answers; None for any other
    request, or a view without ``quick_auth``."""
    if declared is None or declared.quick_auth is None:
        return None
    name, _, value = scope.get("query_string", b"").partition(b"=")
    found = {}
    for header, given in scope["headers"]:
        if header in (b"authorization", b"accept"):
            if header in found:
                return None
            found[header] = given
    if name != b"wait" or found.get(b"accept", b"*/*") not in _JSON_ACCEPTS:
        return None
    try:
        wait = _wait_field(declared.query).run_validation(value.decode("latin-1"))
    except ValidationError:
        return None
    key = declared.quick_auth.key(found.get(b"authorization", b""), kwargs)
    return None if key is None else (wait, key)


@functools.cache
def _wait_field(query: type):
    """The ``wait`` field of a view's query serializer: the view's own check of ``?wait=``."""
    return query().fields["wait"]


@functools.cache
def _allow(view_class: type) -> str:
    view = view_class()
    view.setup(None)  # as ``as_view`` does: HEAD where GET is
    return ", ".join(view.allowed_methods)
