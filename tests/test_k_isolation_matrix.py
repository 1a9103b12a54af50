"""K1, K2, K3: the isolation matrix over EVERY route of the project.

The routes come from the resolver (``django.urls.get_resolver()``, walked recursively),
so a new endpoint without a row in ``ROWS`` (or under a ``PREFIX_ROWS`` family such as
the admin site) fails ``test_k2_every_route_has_an_isolation_row``. Every method a route
allows is tried by every identity in ``IDENTITIES``, against the victim owner's objects:

- anonymous;
- another owner's API token, and another owner's session cookie;
- a machine token on an owner path (the victim's own machine);
- an owner token on a machine path (the victim's own token);
- another machine's token (another owner's machine), and a sibling machine of the same
  owner on machine paths (K2: a machine reaches only its own messages, leases, receipts);
- an old-generation machine token (the victim's machine was re-paired);
- a revoked owner token (the victim rotated it);
- another owner's task approval credential (Q5: it reaches its own task's approvals only).

Each gets the documented refusal: 401 ``not_authenticated`` / ``token_revoked`` /
``authentication_failed``, 403 ``permission_denied`` (wrong kind of credential), 404
``not_found`` for another owner's ids (K2), always with the ``{"error", "detail"}`` shape;
and a digest of every table's rows, taken once before the matrix, is unchanged after every
route's cells. Where a route acts only on the caller's own rows ("self": lists, settings,
rotate), another owner's call is answered for the caller alone: the victim's ids appear
nowhere in the answer, and the victim's own view of the service, read right after the
call, is unchanged (that cell runs inside a savepoint, rolled back after that read so it
cannot disturb the next one; a sibling machine's own calls are the victim's).

The ASGI-level routes outside the urlconf (the worker long-poll in ``core.longpoll``
and the ``/ws/board/`` socket) have their own rows and tests below, on the real ASGI app.
"""
import json
import re
import uuid
from dataclasses import dataclass, field

import pytest
from django.contrib.auth import get_user_model
from django.core.cache import cache
from django.db import transaction
from django.test import Client
from django.urls import URLResolver, get_resolver

from tests.conftest import machine_api, owner_api
from tests.factories import grant_lease, notification_settings, operation_id, push_subscription, submit, table_digest

ADMIN_LOGIN = "/admin/login/"
LOGIN = "/accounts/login/"

# --- the routes ---------------------------------------------------------------------------


def walk_routes(patterns=None, prefix=""):
    """Yield ``(route, pattern)`` for every URL pattern, includes expanded; ``route`` is
    the concatenated pattern text (``api/tasks/<uuid:task_id>/``)."""
    for p in get_resolver().url_patterns if patterns is None else patterns:
        route = prefix + str(p.pattern)
        if isinstance(p, URLResolver):
            yield from walk_routes(p.url_patterns, route)
        else:
            yield route, p


def allowed_methods(pattern) -> list[str]:
    """The HTTP methods a pattern's view answers: a class-based view's handlers (HEAD with
    GET; OPTIONS where the class defines it), else what the row declares."""
    view_class = getattr(pattern.callback, "view_class", None)
    if view_class is None:
        return []
    methods = [m for m in view_class.http_method_names if m != "trace" and hasattr(view_class, m)]
    if "get" in methods and "head" not in methods:
        methods.append("head")
    return sorted(m.upper() for m in methods)


# --- who may call what ----------------------------------------------------------------------

OWNER, MACHINE, OWNER_OR_MACHINE, PUBLIC, PAGE, ADMIN = "owner", "machine", "owner or machine", "public", "page", "admin"


@dataclass
class Row:
    """Who may call a route, how to name the victim's objects in it, and what the
    identities that may not get. ``other`` is the answer to another owner: ``404``
    (default for a path naming the victim's objects), ``("403", code)`` or ``"self"`` (the
    route acts on the caller's rows only; ``self_status`` is its answer). ``machine_other``
    is the same for another owner's machine and ``sibling`` for a sibling machine of the
    same owner (machine paths)."""

    who: str
    kwargs: object = None  # lambda w: path kwargs naming the victim's objects
    bodies: dict = field(default_factory=dict)  # method -> lambda w: JSON body
    query: str = ""
    other: object = 404
    self_status: dict = field(default_factory=dict)  # method -> status, for "self"
    machine_other: object = 404
    sibling: object = 404
    methods: tuple = ()  # for function views (no view class to read them from)
    public_status: dict = field(default_factory=dict)  # method -> status, for PUBLIC rows
    headers: dict = field(default_factory=dict)
    stale_refused: bool = False  # PUBLIC: a revoked credential is still refused (401)
    options_open: bool = False  # PAGE: OPTIONS answers everyone (no login_required on it)
    task_credential: object = ("403", "permission_denied")  # another owner's task approval credential (Q5)


def _task(w):
    return {"task_id": w["task"]}


def _conversation(w):
    return {"task_id": w["conversation"]}


def _session(w):
    return {"session_id": w["session"]}


def _approval(w):
    return {"approval_id": w["approval"]}


def _ask(w):
    return {"key": "matrix", "session": w["session"], "agent": "claude", "tool_name": "Bash", "tool_input": {}}


def _receipt(w):
    return {"event_id": "m1", "generation": w["generation"], "operation_id": w["op"], "kind": "starting",
            "slept_s": 0, "facts": {}}


ROWS = {
    # owner API (SPEC H)
    "api/tasks/": Row(OWNER, bodies={"POST": lambda w: {"machine": w["machine"], "folder": w["folder"], "agent": "demo",
                                                        "prompt": "p"}},
                      other={"GET": "self", "HEAD": "self", "OPTIONS": "self", "POST": ("403", "machine_forbidden")},
                      self_status={"GET": 200, "HEAD": 200, "OPTIONS": 200}, headers={"HTTP_IDEMPOTENCY_KEY": "matrix"}),
    "api/tasks/<uuid:task_id>/": Row(OWNER, kwargs=_task),
    "api/tasks/<uuid:task_id>/cancel/": Row(OWNER, kwargs=_task, bodies={"POST": lambda w: {}}),
    "api/tasks/<uuid:task_id>/entries/": Row(OWNER, kwargs=_task),
    "api/tasks/<uuid:task_id>/integrate/": Row(OWNER, kwargs=_task, bodies={"POST": lambda w: {"action": "discard"}},
                                               headers={"HTTP_IDEMPOTENCY_KEY": "matrix"}),
    # conversations (C2, C4, C5, C7): the victim's live conversation task
    "api/tasks/<uuid:task_id>/messages/": Row(OWNER, kwargs=_conversation, bodies={"POST": lambda w: {"text": "mine now"}},
                                              headers={"HTTP_IDEMPOTENCY_KEY": "matrix"}),
    "api/tasks/<uuid:task_id>/messages/<int:seq>/withdraw/": Row(  # C10
        OWNER, kwargs=lambda w: {"task_id": w["conversation"], "seq": 1}, bodies={"POST": lambda w: {}}),
    "api/tasks/<uuid:task_id>/interrupt/": Row(OWNER, kwargs=_conversation, bodies={"POST": lambda w: {}}),
    "api/tasks/<uuid:task_id>/end/": Row(OWNER, kwargs=_conversation, bodies={"POST": lambda w: {}}),
    "api/budget/": Row(OWNER, other="self", self_status={"GET": 200, "HEAD": 200, "OPTIONS": 200}),
    "api/token/rotate/": Row(OWNER, bodies={"POST": lambda w: {}}, other="self",
                             self_status={"POST": 201, "OPTIONS": 200}),
    "api/machines/": Row(OWNER, other="self", self_status={"GET": 200, "HEAD": 200, "OPTIONS": 200}),
    "api/machines/pairing-codes/": Row(OWNER, bodies={"POST": lambda w: {"machine": w["machine"]}},
                                       other={"POST": 404, "OPTIONS": "self"}, self_status={"OPTIONS": 200}),
    "api/machines/<uuid:machine_id>/unpair/": Row(OWNER, kwargs=lambda w: {"machine_id": w["machine"]},
                                                  bodies={"POST": lambda w: {}}),
    "api/grants/": Row(OWNER, bodies={"POST": lambda w: {"machine": w["machine"], "path": w["folder"] + "/x"}},
                       other={"GET": "self", "HEAD": "self", "OPTIONS": "self", "POST": ("403", "machine_forbidden")},
                       self_status={"GET": 200, "HEAD": 200, "OPTIONS": 200}),
    "api/grants/<uuid:grant_id>/revoke/": Row(OWNER, kwargs=lambda w: {"grant_id": w["grant"]},
                                              bodies={"POST": lambda w: {}}),
    # C8: machine pools (another owner's pool is 404; a pool of the victim's machine made
    # by another owner is refused as machine_forbidden)
    "api/pools/": Row(OWNER, bodies={"POST": lambda w: {"name": "stolen", "machines": [w["machine"]]}},
                      other={"GET": "self", "HEAD": "self", "OPTIONS": "self", "POST": ("403", "machine_forbidden")},
                      self_status={"GET": 200, "HEAD": 200, "OPTIONS": 200}),
    "api/pools/<uuid:pool_id>/": Row(OWNER, kwargs=lambda w: {"pool_id": w["pool"]},
                                     bodies={"PATCH": lambda w: {"name": "stolen"}, "DELETE": lambda w: {}}),
    "api/board/": Row(OWNER, other="self", self_status={"GET": 200, "HEAD": 200, "OPTIONS": 200}),
    "api/sessions/": Row(OWNER, bodies={"POST": lambda w: {"id": w["session"], "title": "mine now"}},
                         other={"GET": "self", "HEAD": "self", "OPTIONS": "self", "POST": 404},
                         self_status={"GET": 200, "HEAD": 200, "OPTIONS": 200}),
    "api/sessions/active/": Row(OWNER, other="self", self_status={"GET": 200, "HEAD": 200, "OPTIONS": 200}),
    "api/sessions/<uuid:session_id>/": Row(OWNER, kwargs=_session, bodies={"PATCH": lambda w: {"title": "x"},
                                                                           "DELETE": lambda w: {}}),
    "api/sessions/<uuid:session_id>/stop/": Row(OWNER, kwargs=_session, bodies={"POST": lambda w: {}}),
    # terminal sessions (T2, T5, T7): the victim's session on her machine, with a message
    "api/sessions/<uuid:session_id>/messages/": Row(OWNER, kwargs=_session, bodies={"POST": lambda w: {"text": "mine now"}},
                                                    headers={"HTTP_IDEMPOTENCY_KEY": "matrix"}),
    "api/sessions/<uuid:session_id>/messages/<int:seq>/withdraw/": Row(
        OWNER, kwargs=lambda w: {"session_id": w["session"], "seq": 1}, bodies={"POST": lambda w: {}}),
    "api/sessions/<uuid:session_id>/interrupt/": Row(OWNER, kwargs=_session, bodies={"POST": lambda w: {}}),
    "api/notifications/settings/": Row(OWNER, bodies={"PUT": lambda w: notification_settings()}, other="self",
                                       self_status={"GET": 200, "HEAD": 200, "PUT": 200, "OPTIONS": 200}),
    "api/push/subscriptions/": Row(OWNER, bodies={"POST": lambda w: push_subscription()}, other="self",
                                   self_status={"POST": 201, "OPTIONS": 200}),
    "api/push/subscriptions/<uuid:subscription_id>/": Row(OWNER, kwargs=lambda w: {"subscription_id": w["subscription"]},
                                                          bodies={"DELETE": lambda w: {}}),
    "api/push/vapid-public-key/": Row(OWNER, other="self", self_status={"GET": 200, "HEAD": 200, "OPTIONS": 200}),
    # approvals (Q1-Q4, Q7): the owner, or a task credential for its own task's approvals
    "api/approvals/": Row(OWNER, bodies={"POST": _ask}, other={"GET": "self", "HEAD": "self", "OPTIONS": "self", "POST": 404},
                          self_status={"GET": 200, "HEAD": 200, "OPTIONS": 200},
                          task_credential={"GET": "self", "HEAD": "self", "OPTIONS": "self",
                                           "POST": ("403", "permission_denied")}),
    "api/approvals/<uuid:approval_id>/": Row(OWNER, kwargs=_approval, self_status={"OPTIONS": 200},
                                             task_credential={"GET": 404, "HEAD": 404, "OPTIONS": "self"}),
    "api/approvals/<uuid:approval_id>/decision/": Row(OWNER, kwargs=_approval, bodies={"POST": lambda w: {"behavior": "allow"}},
                                                      headers={"HTTP_IDEMPOTENCY_KEY": "matrix"}),
    "api/approvals/<uuid:approval_id>/terminal/": Row(OWNER, kwargs=_approval, bodies={"POST": lambda w: {}}),
    # owner or machine (markers, sweeps, jobs: SPEC H, M8)
    "api/sessions/<uuid:session_id>/marker/": Row(
        OWNER_OR_MACHINE, kwargs=_session,
        bodies={"PUT": lambda w: {"turn_id": "t9", "device_id": w["caller_device"], "state": "running"}},
        sibling=None),  # a sibling machine of the owner writes its own device's markers (M8)
    "api/devices/<str:device_id>/sweep/": Row(
        OWNER_OR_MACHINE, kwargs=lambda w: {"device_id": w["machine"]}, bodies={"POST": lambda w: {}},
        other="self", self_status={"POST": 200, "OPTIONS": 200},
        machine_other=("403", "forbidden_device"), sibling=("403", "forbidden_device")),
    "api/sessions/<uuid:session_id>/jobs/": Row(OWNER_OR_MACHINE, kwargs=_session,
                                                bodies={"POST": lambda w: {"job_id": "j9", "mode": "held"}},
                                                sibling=None),
    "api/sessions/<uuid:session_id>/jobs/<str:job_id>/finish/": Row(
        OWNER_OR_MACHINE, kwargs=lambda w: {"session_id": w["session"], "job_id": "j1"},
        bodies={"POST": lambda w: {"wakes": False}}, sibling=None),
    # T2-T4: what became of a message, from the session's own machine only (K2: a sibling is 404)
    "api/sessions/<uuid:session_id>/messages/<int:seq>/delivery/": Row(
        OWNER_OR_MACHINE, kwargs=lambda w: {"session_id": w["session"], "seq": 1},
        bodies={"POST": lambda w: {"state": "delivered", "claim": "matrix"}}),
    # machine API (SPEC H, K2)
    "api/worker/messages/": Row(MACHINE, query="?wait=0", machine_other="self", sibling="self",
                                self_status={"GET": 200, "HEAD": 200, "OPTIONS": 200}),
    "api/worker/messages/<uuid:message_id>/ack/": Row(MACHINE, kwargs=lambda w: {"message_id": w["message"]},
                                                      bodies={"POST": lambda w: {}}),
    "api/worker/leases/": Row(MACHINE, bodies={"POST": lambda w: {"operation_id": w["op"]}},
                              machine_other={"POST": 404, "OPTIONS": "self"}, sibling={"POST": 404, "OPTIONS": "self"},
                              self_status={"OPTIONS": 200}),
    "api/worker/leases/<uuid:lease_id>/renew/": Row(MACHINE, kwargs=lambda w: {"lease_id": w["lease"]},
                                                    bodies={"POST": lambda w: {}}),
    "api/worker/receipts/": Row(MACHINE, bodies={"POST": _receipt},
                                machine_other={"POST": 404, "OPTIONS": "self"}, sibling={"POST": 404, "OPTIONS": "self"},
                                self_status={"OPTIONS": 200}),
    "api/worker/sync/": Row(MACHINE, bodies={"POST": lambda w: {"renew": [{"lease_id": w["lease"]}],
                                                                "receipts": [_receipt(w)]}},
                            machine_other="self", sibling="self", self_status={"POST": 200, "OPTIONS": 200}),
    "api/worker/progress/": Row(MACHINE, bodies={"POST": lambda w: {"operation_id": w["op"], "seq": 1, "output_tail": "x",
                                                                  "last_message": None, "usage": None}},
                                machine_other={"POST": 404, "OPTIONS": "self"}, sibling={"POST": 404, "OPTIONS": "self"},
                                self_status={"OPTIONS": 200}),
    "api/worker/profiles/": Row(MACHINE, bodies={"PUT": lambda w: {"profiles": [{"name": "x", "preset": None}]}},
                                machine_other="self", sibling="self", self_status={"PUT": 200, "OPTIONS": 200}),
    # pairing code (K1): no credential counts; a body without a code is refused before any attempt is counted
    "api/worker/pair/": Row(PUBLIC, bodies={"POST": lambda w: {}}, public_status={"POST": 400, "OPTIONS": 200}),
    # public: the schema, the PWA files, the login pages
    "api/schema/": Row(PUBLIC, public_status={"GET": 200, "HEAD": 200, "OPTIONS": 200}),
    "sw.js": Row(PUBLIC, methods=("GET", "HEAD", "POST"), public_status={"GET": 200, "HEAD": 200, "POST": 405},
                 bodies={"POST": lambda w: {}}),
    "manifest.webmanifest": Row(PUBLIC, methods=("GET", "HEAD", "POST"), public_status={"GET": 200, "HEAD": 200, "POST": 405},
                                bodies={"POST": lambda w: {}}),
    "admin": Row(PUBLIC, public_status={m: 302 for m in ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")},
                 bodies={m: (lambda w: {}) for m in ("POST", "PUT", "PATCH", "DELETE")}),
    "admin/login/": Row(PUBLIC, methods=("GET",), public_status={"GET": 200}),
    "accounts/login/": Row(PUBLIC, bodies={m: lambda w: {"username": "alice", "password": "wrong"} for m in ("POST", "PUT")},
                           public_status={"GET": 200, "HEAD": 200, "POST": 200, "PUT": 200, "OPTIONS": 200}),
    "accounts/password_reset/": Row(PUBLIC, bodies={m: lambda w: {"email": "nobody@example.com"} for m in ("POST", "PUT")},
                                    public_status={"GET": 200, "HEAD": 200, "POST": 302, "PUT": 200, "OPTIONS": 200}),
    "accounts/password_reset/done/": Row(PUBLIC, public_status={"GET": 200, "HEAD": 200, "OPTIONS": 200}),
    "accounts/reset/<uidb64>/<token>/": Row(PUBLIC, kwargs=lambda w: {"uidb64": "MQ", "token": "set-password"},
                                            public_status={"GET": 200, "HEAD": 200, "POST": 200, "PUT": 200, "OPTIONS": 200},
                                            bodies={"POST": lambda w: {}, "PUT": lambda w: {}}),
    "accounts/reset/done/": Row(PUBLIC, public_status={"GET": 200, "HEAD": 200, "OPTIONS": 200}),
    # login required (browser pages); no token logs a browser in
    "": Row(PAGE, methods=("GET",), other="self", self_status={"GET": 200}),
    "tasks/<uuid:task_id>/": Row(PAGE, kwargs=_task, methods=("GET",)),
    "tasks/<uuid:task_id>/data/": Row(PAGE, kwargs=_task, methods=("GET",)),
    "tasks/<uuid:task_id>/decide/": Row(PAGE, kwargs=_task, methods=("POST",),
                                        bodies={"POST": lambda w: {"decision": "abandoned"}}),
    "sessions/<uuid:session_id>/": Row(PAGE, kwargs=_session, methods=("GET",)),  # T6
    "accounts/logout/": Row(PAGE, bodies={"POST": lambda w: {}}, other="self", self_status={"POST": 302, "OPTIONS": 200},
                             options_open=True),
    "admin/logout/": Row(PAGE, methods=("POST",), bodies={"POST": lambda w: {}}, other="self", self_status={"POST": 302}),
    "accounts/password_change/": Row(PAGE, bodies={"POST": lambda w: {}, "PUT": lambda w: {}}, other="self"),
    "accounts/password_change/done/": Row(PAGE, other="self"),
}

# Families: every route under the prefix has the row (the admin site builds its routes
# from the registered models, so a new admin model is covered, and checked, at once).
PREFIX_ROWS = {"admin/": Row(ADMIN, methods=("GET", "POST"))}


def row_for(route: str) -> Row | None:
    if route in ROWS:
        return ROWS[route]
    for prefix, row in PREFIX_ROWS.items():
        if route.startswith(prefix):
            return row
    return None


def test_k2_every_route_has_an_isolation_row():
    """A route of the project without a row here fails: add its row (who may call it, how
    to name another owner's object in it) when you add the endpoint."""
    routes = [route for route, _ in walk_routes()]
    missing = [route for route in routes if row_for(route) is None]
    assert missing == [], f"routes without an isolation row in tests/test_k_isolation_matrix.py: {missing}"
    stale = sorted(set(ROWS) - set(routes))
    assert stale == [], f"rows for routes that no longer exist: {stale}"
    for route, pattern in walk_routes():
        row = row_for(route)
        methods = allowed_methods(pattern) or list(row.methods)
        assert methods, f"{route}: a function view's row must declare its methods"
        for method in methods:
            if method in ("POST", "PUT", "PATCH", "DELETE") and row.who not in (ADMIN,):
                assert method in row.bodies, f"{route} {method}: the row needs a body naming the victim's objects"


# --- the identities -------------------------------------------------------------------------

IDENTITIES = ("anonymous", "other_token", "other_cookie", "machine_on_owner_path", "owner_on_machine_path",
              "other_machine", "sibling_machine", "old_generation", "revoked_owner_token", "other_task_credential")


def expected(row: Row, identity: str, method: str):
    """The documented answer: ``("refuse", status, code)``, ``("self", status)``,
    ``("public", status)``, ``("login", url)``, or None where the identity is not a
    distinct case of this route (an owner token on an owner path is the owner)."""
    def pick(value):
        if isinstance(value, dict):
            value = value.get(method, 404)
        if value is None:
            return None
        if value == "self":
            return ("self", row.self_status[method])
        if isinstance(value, tuple):
            return ("refuse", int(value[0]), value[1])
        return ("refuse", int(value), "not_found")

    if row.who == PUBLIC:
        if row.stale_refused and identity == "old_generation":
            return ("refuse", 401, "token_revoked")
        if row.stale_refused and identity == "revoked_owner_token":
            return ("refuse", 401, "authentication_failed")
        return ("public", row.public_status[method])
    if method == "OPTIONS" and row.who == PAGE and row.options_open:
        return ("public", 200)  # Django's View.options: an Allow header, no data
    if row.who == ADMIN:
        return ("login", ADMIN_LOGIN)
    if row.who == PAGE:
        if identity == "other_cookie":
            return pick(row.other) if row.other != "self" else ("self", row.self_status.get(method, 200))
        if identity in ("owner_on_machine_path", "sibling_machine"):
            return None
        return ("login", LOGIN)
    if method == "OPTIONS":
        # DRF answers OPTIONS after authentication and permissions, before any object is
        # looked up: the same metadata for any id, so nothing about the victim's object.
        answer = _expected_api(row, identity, method, pick)
        if answer is not None and answer[0] == "refuse" and answer[2] not in ("not_authenticated", "permission_denied",
                                                                               "token_revoked", "authentication_failed"):
            return ("self", 200)
        return answer
    return _expected_api(row, identity, method, pick)


def _expected_api(row, identity, method, pick):
    if identity == "anonymous":
        return ("refuse", 401, "not_authenticated")
    if identity == "old_generation":
        return ("refuse", 401, "token_revoked")
    if identity == "revoked_owner_token":
        return ("refuse", 401, "authentication_failed")
    if identity == "other_task_credential":
        return pick(row.task_credential)
    if row.who == OWNER:
        if identity in ("other_token", "other_cookie"):
            return pick(row.other)
        if identity in ("machine_on_owner_path", "other_machine"):
            return ("refuse", 403, "permission_denied")
        return None
    if row.who == MACHINE:
        if identity in ("other_token", "other_cookie", "owner_on_machine_path"):
            return ("refuse", 403, "permission_denied")
        if identity == "other_machine":
            return pick(row.machine_other)
        if identity == "sibling_machine":
            return pick(row.sibling)
        return None
    if row.who == OWNER_OR_MACHINE:
        if identity in ("other_token", "other_cookie"):
            return pick(row.other)
        if identity == "other_machine":
            return pick(row.machine_other)
        if identity == "sibling_machine":
            return pick(row.sibling)
        return None
    raise AssertionError(f"unknown row kind {row.who}")


# --- the world --------------------------------------------------------------------------------


def victim_view(w) -> dict:
    """What the victim sees through the API, her token and her login session."""
    from django.contrib.sessions.models import Session as LoginSession
    from rest_framework.authtoken.models import Token

    api = owner_api(w["victim"])
    view = {p: api.get(p).json() for p in ("/api/board/", "/api/budget/", "/api/notifications/settings/",
                                           "/api/tasks/", "/api/machines/", "/api/grants/", "/api/sessions/",
                                           "/api/pools/")}
    view["token"] = Token.objects.get(user=w["victim"]).key
    view["login_session"] = LoginSession.objects.filter(session_key=w["victim_cookie"]).exists()
    return view


@pytest.fixture
def world(owner, other_owner, machine, grant, make_machine, pinned):
    """The victim (alice) owns one of everything: a task with its operation, lease and
    start message, a live conversation task with a message (C2), a session with a held job and a running marker of her machine's device,
    a pending pairing code, a push subscription, a browser login. Then she re-pairs her
    machine (its old token is the old generation) and rotates her API token (the old one
    is revoked). The attacker (mallory) has a token, a browser login and a machine; alice
    has a second (sibling) machine."""
    from rest_framework.authtoken.models import Token

    from notifications import services as notify
    from tasks_app.models import Grant, Machine, Task
    from tasks_app.services.approvals import task_credential_issue

    task_id = submit(owner, machine, grant.path).json()["id"]
    (message,) = machine_api(machine).get("/api/worker/messages/?wait=0").json()["messages"]
    lease_id = grant_lease(machine, task_id).json()["lease_id"]
    api = owner_api(owner)
    # a live conversation (C1) with a message, for the conversation routes
    profiles = {"profiles": [{"name": "claude", "preset": "claude", "conversation": "live"}]}
    assert machine_api(machine).put("/api/worker/profiles/", profiles, format="json").status_code == 200
    conversation = submit(owner, machine, grant.path, agent="claude", mode="conversation", exclusive=False).json()
    assert conversation["conversation"] == "live"
    assert api.post(f"/api/tasks/{conversation['id']}/messages/", {"text": "hi"}, format="json",
                    HTTP_IDEMPOTENCY_KEY="victim").status_code == 201
    session_id = str(uuid.uuid4())
    assert api.post("/api/sessions/", {"id": session_id, "title": "alice's", "machine": str(machine.id),
                                       "channel": "terminal"}, format="json").status_code == 201
    assert api.post(f"/api/sessions/{session_id}/messages/", {"text": "hi"}, format="json",
                    HTTP_IDEMPOTENCY_KEY="victim").status_code == 201
    assert api.post(f"/api/sessions/{session_id}/jobs/", {"job_id": "j1", "mode": "held"}, format="json").status_code == 201
    marker = {"turn_id": "t1", "device_id": str(machine.id), "state": "running"}
    assert machine_api(machine).put(f"/api/sessions/{session_id}/marker/", marker, format="json").status_code == 200
    subscription = api.post("/api/push/subscriptions/", push_subscription(), format="json").json()["id"]
    approval = api.post("/api/approvals/", {**_ask({"session": session_id}), "key": "victim"}, format="json").json()["id"]
    pool = api.post("/api/pools/", {"name": "desk", "machines": [str(machine.id)]}, format="json").json()["id"]  # C8
    notify.vapid_key()
    # re-pair alice's machine: the current token is new, the old one is the old generation
    old_machine_token = machine.test_token
    code = api.post("/api/machines/pairing-codes/", {"machine": str(machine.id)}, format="json").json()["code"]
    paired = Client().post("/api/worker/pair/", {"code": code}, content_type="application/json").json()
    machine.test_token = paired["token"]
    assert paired["generation"] == 2
    # rotate alice's API token
    revoked_owner_token = owner.auth_token.key
    assert api.post("/api/token/rotate/").status_code == 201
    owner = get_user_model().objects.get(pk=owner.pk)
    assert Token.objects.get(user=owner).key != revoked_owner_token
    sibling = make_machine(owner, name="alice-desktop")
    attacker_machine = make_machine(other_owner, name="mallory-laptop")
    attacker_grant = Grant.objects.create(owner=other_owner, machine=attacker_machine, path=grant.path + "-mallory")
    attacker_task = Task.objects.get(pk=submit(other_owner, attacker_machine, attacker_grant.path).json()["id"])
    attacker_credential = task_credential_issue(attacker_task)
    Machine.objects.update(last_heard_at=pinned_now())  # P2 writes last_heard_at at most every 20 s
    victim_browser, attacker_browser = Client(), Client()
    victim_browser.force_login(owner)
    attacker_browser.force_login(other_owner)
    return {
        "victim": owner, "attacker": other_owner, "victim_cookie": victim_browser.cookies["sessionid"].value,
        "attacker_cookie": attacker_browser.cookies["sessionid"].value, "task": task_id, "op": operation_id(task_id), "lease": lease_id,
        "conversation": conversation["id"],
        "message": message["id"], "session": session_id, "machine": str(machine.id), "grant": str(grant.id),
        "folder": grant.path, "generation": 2, "subscription": subscription, "approval": approval, "pool": pool,
        "devices": {"machine_on_owner_path": str(machine.id), "other_machine": str(attacker_machine.id),
                    "sibling_machine": str(sibling.id), "old_generation": str(machine.id)},
        "credentials": {
            "anonymous": None,
            "other_token": f"Token {Token.objects.get(user=other_owner).key}",
            "other_cookie": "cookie",
            "machine_on_owner_path": f"Machine {machine.test_token}",
            "owner_on_machine_path": f"Token {Token.objects.get(user=owner).key}",
            "other_machine": f"Machine {attacker_machine.test_token}",
            "sibling_machine": f"Machine {sibling.test_token}",
            "old_generation": f"Machine {old_machine_token}",
            "revoked_owner_token": f"Token {revoked_owner_token}",
            "other_task_credential": f"Task {attacker_credential}",
        },
    }


def _random_kwargs(kwargs: dict) -> dict:
    return {k: uuid.uuid4() if _is_uuid(v) else v for k, v in kwargs.items()}


def _is_uuid(value) -> bool:
    try:
        uuid.UUID(str(value))
    except ValueError:
        return False
    return True


def pinned_now():
    from core import clock

    return clock.now()


def victim_ids(w) -> list[str]:
    return [w[k] for k in ("task", "op", "lease", "message", "session", "machine", "grant", "subscription", "approval",
                           "conversation")]


# --- the matrix --------------------------------------------------------------------------------


def concrete_path(route: str, pattern, row: Row, w) -> str:
    """The route with the victim's objects in its parameters."""
    if row.who == ADMIN:
        return "/" + admin_path(route, pattern, w)
    kwargs = row.kwargs(w) if row.kwargs else {}
    path = re.sub(r"<(?:\w+:)?(\w+)>", lambda m: str(kwargs[m.group(1)]), route)
    return "/" + path + row.query


def admin_path(route: str, pattern, w) -> str:
    """An admin route filled in: object ids are the victim's rows of that model."""
    from django.apps import apps

    if "(?P<app_label>" in route:
        label = re.search(r"\(\?P<app_label>(\w+)", route).group(1)
        return f"admin/{label}/"
    if "(?P<url>" in route:
        return "admin/tasks_app/nothing-here/"
    object_id = "1"
    match = re.match(r"admin/(\w+)/(\w+)/", route)
    if match and "<path:object_id>" in route:
        label = f"{match.group(1)}.{match.group(2)}"
        if label not in w.setdefault("admin_ids", {}):  # once per model, not per cell
            first = apps.get_model(label)._default_manager.order_by("pk").first()
            w["admin_ids"][label] = str(first.pk) if first else "1"
        object_id = w["admin_ids"][label]
    route = route.replace("<path:object_id>", object_id).replace("<int:content_type_id>", "1")
    return route


def send(w, identity: str, method: str, path: str, body, headers: dict):
    client = Client()
    if identity == "other_cookie":
        client.cookies["sessionid"] = w["attacker_cookie"]
    extra = dict(headers)
    credential = w["credentials"][identity]
    if credential and credential != "cookie":
        extra["HTTP_AUTHORIZATION"] = credential
    data = json.dumps(body) if body is not None else None
    if method in ("GET", "HEAD"):
        return getattr(client, method.lower())(path, **extra)
    if method == "OPTIONS":
        return client.options(path, **extra)
    if path.startswith(("/accounts/", "/admin/", "/tasks/")):
        return client.generic(method, path, _form(body), content_type="application/x-www-form-urlencoded", **extra)
    return client.generic(method, path, data or "", content_type="application/json", **extra)


def _form(body) -> str:
    from urllib.parse import urlencode

    return urlencode(body or {})


def check_cell(w, route, pattern, row, identity, method) -> str | None:
    """Run one cell; returns a description of what went wrong, or None."""
    want = expected(row, identity, method)
    if want is None:
        return "n/a"
    w["caller_device"] = w["devices"].get(identity, "laptop")
    path = concrete_path(route, pattern, row, w)
    if want[0] == "self" and method == "OPTIONS" and row.kwargs:
        path = concrete_path(route, pattern, Row(row.who, kwargs=lambda w: _random_kwargs(row.kwargs(w))), w)
    body = row.bodies[method](w) if method in row.bodies else None
    cache.clear()
    label = f"{identity} {method} {path}"
    if want[0] == "self":
        # The victim's view before the call: where the last "self" cell left it (its
        # savepoint rolled back; every other cell since changed no row: the routes' digests
        # say so, and a change drops this) with the clock pinned. After the call, inside
        # the savepoint: what another owner's call did, as the victim would see it. The
        # view is read from the database alone (clock pinned, cache cleared): a call that
        # changed no row at all cannot have changed it, so the view (eight API reads,
        # two thirds of the matrix's time) is read again only when a row changed.
        if "victim_view" not in w:
            w["victim_view"] = victim_view(w)
        before, rows_before = w["victim_view"], table_digest()
        sid = transaction.savepoint()
        try:
            response = send(w, identity, method, path, body, row.headers)
            text = response.content.decode(errors="replace")
            problems = []
            if response.status_code != want[1]:
                problems.append(f"{label}: {response.status_code} (want {want[1]}) {text[:200]}")
            leaked = [i for i in victim_ids(w) if i in text]
            if leaked:
                problems.append(f"{label}: the answer names the victim's {leaked}")
            # A sibling machine is the victim's own: its own calls may change her view.
            if identity != "sibling_machine" and table_digest() != rows_before and victim_view(w) != before:
                problems.append(f"{label}: the victim's view changed")
        finally:
            transaction.savepoint_rollback(sid)
        return "; ".join(problems) or None
    response = send(w, identity, method, path, body, row.headers)
    text = response.content.decode(errors="replace")
    problems = []
    if want[0] == "refuse":
        _, status, code = want
        if response.status_code != status:
            problems.append(f"{label}: {response.status_code} (want {status} {code}) {text[:200]}")
        elif row.who == PAGE:  # an HTML page's 404: nothing of the victim's object on it
            leaked = [i for i in victim_ids(w) if i in text and i not in path]
            if leaked:
                problems.append(f"{label}: the page names the victim's {leaked}")
        elif method != "HEAD":
            try:
                payload = response.json()
            except ValueError:
                payload = None
            if not (isinstance(payload, dict) and isinstance(payload.get("error"), str)
                    and isinstance(payload.get("detail"), str) and payload["detail"]):
                problems.append(f"{label}: not the error shape: {text[:200]}")
            elif payload["error"] != code:
                problems.append(f"{label}: error {payload['error']!r} (want {code!r})")
    elif want[0] == "public":
        if response.status_code != want[1]:
            problems.append(f"{label}: {response.status_code} (want {want[1]}) {text[:200]}")
    elif want[0] == "login":
        location = response.get("Location", "")
        if response.status_code != 302 or not location.startswith(want[1]):
            problems.append(f"{label}: {response.status_code} {location!r} (want a redirect to {want[1]})")
    return "; ".join(problems) or None


def run_matrix(w, routes) -> tuple[int, list[str]]:
    """Every cell of ``routes``; then, once per route (all its methods and identities),
    the digest of every table against the one before: a change names the route and the
    tables. Per route, not per cell: the digests were 40 % of the matrix's time on
    PostgreSQL (3,580 admin cells), and a route's cells share one row of the table."""
    baseline = table_digest()
    cells, failures = 0, []
    for route, pattern in routes:
        row = row_for(route)
        tried = []
        for method in allowed_methods(pattern) or list(row.methods):
            for identity in IDENTITIES:
                try:
                    outcome = check_cell(w, route, pattern, row, identity, method)
                except KeyError as exc:
                    outcome = f"{route} {method} {identity}: the row lacks {exc}"
                if outcome == "n/a":
                    continue
                cells += 1
                tried.append(f"{identity} {method}")
                if outcome:
                    failures.append(outcome)
        after = table_digest()
        if after != baseline:
            changed = sorted(t for t in after if after[t] != baseline.get(t))
            baseline.clear()
            baseline.update(after)  # report this route, not every route after it
            w.pop("victim_view", None)
            failures.append(f"{route} (one of {', '.join(tried)}): the database changed: {changed}")
    return cells, failures


def test_k2_isolation_matrix_api_pages_and_public_routes(world):
    """Every non-admin route x method x identity: the documented refusal with the error
    shape, nothing changed (see the module docstring)."""
    routes = [(r, p) for r, p in walk_routes() if not r.startswith("admin/")]
    cells, failures = run_matrix(world, routes)
    print(f"isolation matrix: {len(routes)} routes, {cells} cells")
    assert failures == [], "\n".join(failures)
    assert cells > 300


def test_k2_admin_site_refuses_everyone_but_staff(world):
    """Every admin route (built from the registered models) redirects anonymous callers,
    API tokens (owner or machine) and a non-staff owner's browser to the admin login, and
    changes nothing."""
    routes = [(r, p) for r, p in walk_routes() if r.startswith("admin/") and r not in ROWS]
    cells, failures = run_matrix(world, routes)
    print(f"admin matrix: {len(routes)} routes, {cells} cells")
    assert failures == [], "\n".join(failures)
    assert len(routes) > 50


def test_k2_admin_answers_staff(owner, other_owner):
    """The control for the admin rows: a staff member reaches the admin; the same owner
    without staff status is sent to the admin login."""
    browser = Client()
    browser.force_login(other_owner)
    assert browser.get("/admin/")["Location"].startswith(ADMIN_LOGIN)
    other_owner.is_staff = True
    other_owner.save(update_fields=["is_staff"])
    assert browser.get("/admin/").status_code == 200
