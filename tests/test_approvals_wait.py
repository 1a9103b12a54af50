"""SPEC Q3 on the service: ``GET /api/approvals/{id}/?wait=S`` is a long-poll of the one
wait (``core.longpoll``): on daphne it is answered by the decision's after-commit wake-up,
not by a timer, and by the safety re-check for an expiry nobody announced; under WSGI the
same wait runs in the request's thread (its sync form). Tests wait on the fact "the read
waits" (``core.longpoll``'s DEBUG line, or ``waiting(key)`` in process), never on a sleep."""
import time
import uuid

import httpx
import pytest

from core.longpoll import waiting
from sessions_app.approvals import approval_key
from tests.conftest import owner_api
from tests.live import Background, live_daphne  # noqa: F401  (fixture)
from tests.wait import wait_for

pytestmark = [pytest.mark.django_db(transaction=True)]
DEBUG = {"RUNSTEAD_LOG_LEVEL": "DEBUG"}  # core.longpoll logs each wait that begins waiting
BASH = {"command": "make test"}


def _headers(owner, **extra) -> dict:
    return {"Authorization": f"Token {owner.auth_token.key}", **extra}


def _ask(url, owner) -> dict:
    body = {"key": f"k-{uuid.uuid4()}", "session": str(uuid.uuid4()), "agent": "claude", "tool_name": "Bash",
            "tool_input": BASH}
    answer = httpx.post(url + "/api/approvals/", json=body, headers=_headers(owner), timeout=10)
    assert answer.status_code == 201, answer.text
    return answer.json()


def _read(url, owner, approval_id, wait):
    return httpx.get(f"{url}/api/approvals/{approval_id}/", params={"wait": wait}, headers=_headers(owner),
                     timeout=wait + 10)


def test_q3_a_waiting_read_is_answered_by_the_decision_not_by_a_timer(live_daphne, owner):
    # Re-check every 30 s: only the decision's after-commit wake-up can answer within 3 s.
    url = live_daphne(RUNSTEAD_LONGPOLL_RECHECK_S="30", **DEBUG)
    approval = _ask(url, owner)
    read = Background(_read, url, owner, approval["id"], 20)
    live_daphne.servers[-1].wait_waiting(key=approval_key(approval["id"]))  # pending: the read waits
    decided = time.monotonic()
    decision = httpx.post(f"{url}/api/approvals/{approval['id']}/decision/", json={"behavior": "deny", "message": "no"},
                          headers=_headers(owner, **{"Idempotency-Key": "d-1"}), timeout=10)
    assert decision.status_code == 200, decision.text
    answer = read.result(10)
    took = time.monotonic() - decided
    assert answer.status_code == 200
    assert (answer.json()["state"], answer.json()["message"]) == ("denied", "no")
    assert took < 3, f"the waiting read answered {took:.2f} s after the decision"


def test_q3_d1_a_waiting_approval_read_sends_no_keepalive_spaces(live_daphne, owner):
    """The hook bounds each read by its wait plus slack (``machine/hooks/approval.py``), not
    by silence as the worker's pull does: a waiting approval read sends nothing until its
    answer, a whole JSON response, while the pull on the same daphne gets its spaces
    (``tests/test_longpoll.py``). 1,000 waiting hooks would cost 333 writes a second."""
    url = live_daphne(RUNSTEAD_LONGPOLL_KEEPALIVE_S="0.3")
    approval = _ask(url, owner)
    started = time.monotonic()
    answer = _read(url, owner, approval["id"], 2)
    assert answer.status_code == 200 and time.monotonic() - started >= 1.5  # 2 s less its end jitter
    assert answer.content.startswith(b"{") and int(answer.headers["content-length"]) == len(answer.content)
    assert answer.json()["state"] == "pending"


def test_q3_an_expiry_ends_the_wait_through_the_safety_recheck(live_daphne, owner):
    # Nothing announces an expiry that only time makes: the re-check's take expires it.
    url = live_daphne(RUNSTEAD_APPROVAL_WAIT_S="1", RUNSTEAD_LONGPOLL_RECHECK_S="0.3", **DEBUG)
    approval = _ask(url, owner)
    answer = _read(url, owner, approval["id"], 20)
    assert (answer.json()["state"], answer.json()["decided_by"]) == ("expired", "timeout")
    assert live_daphne.servers[-1].waits().count(approval_key(approval["id"])) >= 1  # it did wait first


def test_q3_a_decided_approval_answers_at_once(live_daphne, owner):
    url = live_daphne()
    approval = _ask(url, owner)
    httpx.post(f"{url}/api/approvals/{approval['id']}/decision/", json={"behavior": "allow"},
               headers=_headers(owner, **{"Idempotency-Key": "d-1"}), timeout=10)
    started = time.monotonic()
    assert _read(url, owner, approval["id"], 25).json()["state"] == "allowed"
    assert time.monotonic() - started < 5


def test_q3_sync_form_under_wsgi_is_woken_by_the_decision(owner):
    api = owner_api(owner)
    body = {"key": "k-sync", "session": str(uuid.uuid4()), "agent": "claude", "tool_name": "Bash", "tool_input": BASH}
    approval = api.post("/api/approvals/", body, format="json").json()
    read = Background(owner_api(owner).get, f"/api/approvals/{approval['id']}/", {"wait": 20})
    # the read's first take found it pending
    wait_for(lambda: waiting(approval_key(approval["id"])) >= 1, timeout_s=10, interval_s=0.01, what="the read to wait")
    assert api.post(f"/api/approvals/{approval['id']}/decision/", {"behavior": "allow", "scope": "session"},
                    format="json", HTTP_IDEMPOTENCY_KEY="d-1").status_code == 200
    answer = read.result(5)
    assert (answer.status_code, answer.json()["state"], answer.json()["scope"]) == (200, "allowed", "session")


def test_q3_the_safety_recheck_is_one_query_for_all_waiting_approvals(owner, django_assert_num_queries):
    """D1/Q3: the re-check asks once which of the waiting approvals a take would now answer
    (decided, past ``expires_at``, or gone), instead of one take per waiting hook (bench:
    500 waiting hooks made 100 takes/s)."""
    from datetime import timedelta

    from core import clock
    from sessions_app.approvals import approvals_ready
    from sessions_app.models import Approval

    api = owner_api(owner)
    ids = [api.post("/api/approvals/", {"key": f"k-{n}", "session": str(uuid.uuid4()), "agent": "claude",
                                        "tool_name": "Bash", "tool_input": BASH}, format="json").json()["id"]
           for n in range(4)]
    pending, decided, due = ids[0], ids[1], ids[2]
    assert api.post(f"/api/approvals/{decided}/decision/", {"behavior": "allow"}, format="json",
                    HTTP_IDEMPOTENCY_KEY="d-1").status_code == 200
    Approval.objects.filter(pk=due).update(expires_at=clock.now() - timedelta(seconds=1))
    Approval.objects.filter(pk=ids[3]).delete()
    keys = [approval_key(i) for i in ids]
    with django_assert_num_queries(1):
        found = approvals_ready(keys)
    assert found == {approval_key(decided), approval_key(due), approval_key(ids[3])}
    assert approval_key(pending) not in found
