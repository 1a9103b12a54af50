"""Waiting approval hooks as cheap as waiting workers (issue 44; SPEC Q3, K1, D1): the
usual start of an owner's approval long-poll (``GET /api/approvals/{id}/?wait=S`` with
``Authorization: Token``) is answered on the event loop without DRF's dispatch, from
this process's owner tokens (``tasks_app.auth.OwnerTokenCache``) and approval owners
(``sessions_app.approvals.ApprovalOwners``); the starts of one event loop read their
approvals in one query (``approvals_starts``). Anything else goes to the view, with its
errors. The token cache needs the shared counter in Redis, so these run in the
PostgreSQL + Redis pass; the figures: ``bench/README.md``."""
import asyncio
import logging
import re
import uuid

import pytest
from django.db import connection, connections
from django.test.utils import CaptureQueriesContext

from core.longpoll.router import _dispatch, _resolve, _warm
from core.longpoll.view import quick_start
from sessions_app.api.approvals import ApprovalDetail, OwnersApproval
from sessions_app.approvals import approval_wait, approvals_starts
from sessions_app.models import Approval, ApprovalState
from tests.conftest import PINNED_AT, owner_api

pytestmark = pytest.mark.postgres


def _scope(approval_id, query: bytes = b"wait=25", *headers: tuple[bytes, bytes]) -> dict:
    return {"type": "http", "method": "GET", "path": f"/api/approvals/{approval_id}/", "query_string": query,
            "headers": [(b"host", b"testserver"), *headers], "client": ("127.0.0.1", 1),
            "server": ("testserver", 80), "scheme": "http", "root_path": ""}


def _token(user) -> tuple[bytes, bytes]:
    return (b"authorization", f"Token {user.auth_token.key}".encode())


def _start(approval_id, *headers, query=b"wait=25"):
    """(the quick start's answer or None, the view's answer) to one start."""
    found = _resolve(f"/api/approvals/{approval_id}/")
    scope = _scope(approval_id, query, *headers)
    return quick_start(ApprovalDetail, scope, found.kwargs), _dispatch(found, scope)


def _ask(user) -> str:
    """A new pending approval of ``user``'s (Q1), in a session of its own (an approval
    asked in a session withdraws the one pending there)."""
    body = {"key": f"k-{uuid.uuid4()}", "session": str(uuid.uuid4()), "agent": "claude", "tool_name": "Bash",
            "tool_input": {"command": "make"}, "cwd": "/Users/alice/src/shop"}
    asked = owner_api(user).post("/api/approvals/", body, format="json")
    assert asked.status_code == 201, asked.content
    return asked.json()["id"]


def _allow(user, approval_id) -> None:
    decided = owner_api(user).post(f"/api/approvals/{approval_id}/decision/", {"behavior": "allow"}, format="json",
                                   HTTP_IDEMPOTENCY_KEY=f"d-{uuid.uuid4()}")
    assert decided.status_code == 200, decided.content


def _warmed(user, *approval_ids) -> None:
    OwnersApproval.warm([(user.auth_token.key, str(a)) for a in approval_ids])


def _finished(response, result) -> tuple[int, list, bytes]:
    response.finish(result)
    return response.status_code, sorted(response.items()), response.content


@pytest.mark.django_db
def test_q3_k1_an_owners_approval_wait_starts_as_the_view_does(owner):
    """The same wait (the approval's key, the asked seconds, not exclusive) and, rendered
    from the same result, the same status, headers and body as the view's."""
    approval_id = _ask(owner)
    _warmed(owner, approval_id)
    for accept in ([], [(b"accept", b"*/*")], [(b"accept", b"application/json")]):
        quick, viewed = _start(approval_id, _token(owner), *accept, query=b"wait=12.5")
        assert quick is not None and str(quick.wait.subject.pk) == approval_id
        assert (quick.wait.key, quick.wait.timeout_s, quick.wait.exclusive) == (viewed.wait.key, 12.5, False)
        current = Approval.objects.select_related("session", "task").get(pk=approval_id)
        assert _finished(quick, current) == _finished(viewed, current)


@pytest.mark.django_db
def test_k1_q7_every_other_approval_wait_start_is_left_to_the_view(owner, other_owner, settings):
    """What the quick start cannot vouch for without I/O goes to the view, which answers
    its error (K1, K2, K3) or the wait: another owner's approval (404), an unknown one,
    a rotated token (401), an owner made inactive (401), a counter not read lately, a
    wait out of range (400), no ``?wait=``, a text ``Accept`` (406), a malformed header."""
    mine, theirs = _ask(owner), _ask(other_owner)
    unknown = "00000000-0000-4000-8000-000000000000"
    _warmed(owner, mine, theirs, unknown)
    assert _start(mine, _token(owner))[0] is not None  # the usual start, for contrast
    cases = {
        "another_owners": (theirs, [_token(owner)], b"wait=1", 404, "not_found"),
        "unknown_approval": (unknown, [_token(owner)], b"wait=1", 404, "not_found"),
        "wait_over_25": (mine, [_token(owner)], b"wait=25.5", 400, "invalid"),
        "no_wait": (mine, [_token(owner)], b"", 200, None),
        "accept_text": (mine, [_token(owner), (b"accept", b"text/plain")], b"wait=1", 406, "not_acceptable"),
        "three_words": (mine, [(b"authorization", f"Token {owner.auth_token.key} x".encode())], b"wait=1", 401,
                        "authentication_failed"),
    }
    for case, (approval_id, headers, query, status, error) in cases.items():
        quick, viewed = _start(approval_id, *headers, query=query)
        assert quick is None, case
        assert (viewed.status_code, (getattr(viewed, "data", None) or {}).get("error")) == (status, error), case
    settings.RUNSTEAD_TOKEN_EPOCH_FRESH_S = 0  # the counter must be read again: that is I/O
    assert _start(mine, _token(owner))[0] is None


@pytest.mark.django_db
def test_k1_a_rotated_owner_token_or_an_inactive_owner_is_refused_at_once(owner, make_owner):
    """K1: ``POST /api/token/rotate/`` and an owner made inactive move the counter in their
    transaction (``owner_tokens_changed``): the cached token no longer starts a wait, and
    the view refuses it."""
    approval_id = _ask(owner)
    old = owner.auth_token.key
    _warmed(owner, approval_id)
    assert _start(approval_id, _token(owner))[0] is not None
    rotated = owner_api(owner).post("/api/token/rotate/")
    assert rotated.status_code == 201
    quick, viewed = _start(approval_id, (b"authorization", f"Token {old}".encode()))
    assert quick is None and viewed.status_code == 401
    owner.refresh_from_db()
    _warmed(owner, approval_id)
    assert _start(approval_id, _token(owner))[0] is not None  # the new token, once read

    other = make_owner()
    theirs = _ask(other)
    _warmed(other, theirs)
    assert _start(theirs, _token(other))[0] is not None
    other.is_active = False
    other.save()
    quick, viewed = _start(theirs, _token(other))
    assert quick is None and viewed.status_code == 401


@pytest.mark.django_db(transaction=True)
def test_q3_d1_a_wave_of_hook_starts_reads_tokens_and_approvals_once(owner, caplog, settings):
    """A wave of starts the quick start cannot answer yet (after a restart) joins one
    batch: ONE read of the tokens (``FOR KEY SHARE``, with their owners ``FOR SHARE``)
    and one of the approvals' owners; then the quick start answers each."""
    settings.RUNSTEAD_TOKEN_EPOCH_FRESH_S = 30  # the counter read by the batch is still fresh when checked below
    ids = [_ask(owner) for _ in range(20)]
    starts = [(_scope(i, b"wait=25", _token(owner)), _resolve(f"/api/approvals/{i}/")) for i in ids]
    assert all(quick_start(ApprovalDetail, scope, found.kwargs) is None for scope, found in starts)

    async def wave():
        return await asyncio.gather(*(_warm(found, scope) for scope, found in starts))

    with caplog.at_level(logging.DEBUG, logger="runstead.auth"), caplog.at_level(logging.DEBUG,
                                                                                  logger="runstead.approvals"):
        assert asyncio.run(wave()) == [True] * len(starts)
    assert re.findall(r"owner token cache: (\d+) missed", caplog.text) == ["1"]  # one token, read once
    assert re.findall(r"approval owners: (\d+) missed", caplog.text) == ["20"]  # one query for the wave
    assert all(quick_start(ApprovalDetail, scope, found.kwargs) is not None for scope, found in starts)


@pytest.mark.django_db
def test_q3_starts_read_their_approvals_in_one_query_and_only_the_decided_take(owner, pinned):
    """``approvals_starts``: one query for the batch; a pending approval is the wait's
    first result (its subject refreshed in place, related rows too), a decided one, one
    past ``expires_at`` and a gone one make their first take."""
    pending, decided, due = (_ask(owner) for _ in range(3))
    _allow(owner, decided)
    Approval.objects.filter(pk=due).update(expires_at=PINNED_AT)  # due now: the take expires it
    gone = "00000000-0000-4000-8000-000000000000"
    waits = [approval_wait(approval=Approval(pk=pk), wait_s=25) for pk in (pending, decided, due, gone)]
    with CaptureQueriesContext(connection) as queries:
        take = approvals_starts(waits)
    assert len(queries) == 1
    assert take == {w.key for w in waits[1:]}
    first = waits[0].empty
    assert first is waits[0].subject and first.state == ApprovalState.PENDING and first.tool_name == "Bash"
    with CaptureQueriesContext(connection) as queries:
        assert first.session.title is not None  # read with it: rendering needs no query
    assert len(queries) == 0


@pytest.mark.django_db(transaction=True)
def test_q3_d1_a_hook_waiting_again_after_a_quiet_timeout_reads_nothing_until_a_decision_wakes_it(owner):
    """Issue 44: a hook's long-poll that timed out on a pending approval, with no wake-up of
    the approval since, starts its next wait from that result (``Wait.resume``): no read
    (``approvals_starts`` not called) and the same approval; a decision wakes the key, so
    the start after it takes and answers the decision at once."""
    from dataclasses import replace

    from asgiref.sync import sync_to_async

    from core.longpoll import take_or_wait

    approval_id = _ask(owner)
    reads = []

    def counted(waits):
        reads.append(len(waits))
        return approvals_starts(waits)

    def wait(seconds):
        return replace(approval_wait(approval=Approval(pk=approval_id), wait_s=seconds), starts=counted)

    async def hook():
        first = await take_or_wait(wait(0.3))
        again = await take_or_wait(wait(0.3))
        seen = list(reads)
        await sync_to_async(_decide_and_close, thread_sensitive=False)(owner, approval_id)
        decided = await take_or_wait(wait(5))
        return first, again, seen, decided

    def _decide_and_close(user, pk):
        try:
            _allow(user, pk)
        finally:
            connections.close_all()  # this thread's connection goes back to the pool (the test client keeps it)

    first, again, seen, decided = asyncio.run(hook())
    assert first.state == again.state == ApprovalState.PENDING
    assert (str(again.pk), again.tool_name, again.session.title) == (approval_id, "Bash", first.session.title)
    assert seen == [1], "the second start read the approval although nothing had happened"
    # The decision's wake-up found no wait of the key here, so the start after it took at
    # once, outside the batch (``take_missed``): no ``starts`` call, and the decision.
    assert reads == [1] and decided.state == ApprovalState.ALLOWED
