"""``POST /api/worker/sync/`` (issue 44): one request renews all of a machine's leases and
carries a batch of its receipts; each item is answered as its own request would be (L2,
L5, L10; R1-R3), receipts applied once per ``event_id`` whichever way they came (R1);
a malformed item refuses the whole request and changes nothing (K3)."""
import uuid

import pytest

from core import clock
from tasks_app.models import Lease, Receipt, Task
from tests.conftest import machine_api, owner_api
from tests.factories import final_facts, grant_lease, operation_id, receipt, submit, table_digest

pytestmark = pytest.mark.django_db

RUNNING = {"pid": 7, "pgid": 7, "process_start_time": 1.0}


def leased(owner, machine, folder) -> tuple[str, str]:
    task_id = submit(owner, machine, folder, exclusive=False).json()["id"]
    answer = grant_lease(machine, task_id)
    assert answer.status_code == 201, answer.content
    return task_id, answer.json()["lease_id"]


def body(machine, task_id, kind, facts, event_id):
    return {"event_id": event_id, "generation": machine.generation, "operation_id": operation_id(task_id),
            "kind": kind, "slept_s": 0.0, "facts": facts}


def sync(machine, **items):
    return machine_api(machine).post("/api/worker/sync/", items, format="json")


def test_r1_l2_one_sync_renews_every_lease_and_applies_each_receipt_once(owner, machine, grant, pinned):
    """Two leased tasks: one sync renews both (L2: from the service's now) and carries a
    short task's whole queue of receipts (running, final) with the other's running
    receipt; the same receipts again, alone or in another sync, get their first answers
    and change nothing (R1)."""
    short, short_lease = leased(owner, machine, grant.path)
    long, long_lease = leased(owner, machine, grant.path)
    pinned.shift(15)
    receipts = [body(machine, short, "running", RUNNING, "s-1"),
                body(machine, short, "final", final_facts(runtime_s=3.0), "s-2"),
                body(machine, long, "running", RUNNING, "l-1")]
    answer = sync(machine, renew=[{"lease_id": short_lease}, {"lease_id": long_lease, "output_tail": "working\n"}],
                  receipts=receipts)
    assert answer.status_code == 200, answer.content
    got = answer.json()
    assert [(a["status"], a["lease"]["lease_id"]) for a in got["leases"]] == [(200, short_lease), (200, long_lease)]
    expires = (clock.now().timestamp() + 60)
    assert all(Lease.objects.get(pk=a["lease"]["lease_id"]).expires_at.timestamp() == expires for a in got["leases"])
    assert got["receipts"] == [{"event_id": e, "status": 200, "answer": {"outcome": "applied"}}
                               for e in ("s-1", "s-2", "l-1")]
    assert (Task.objects.get(pk=short).state, Task.objects.get(pk=long).state) == ("succeeded", "running")
    assert Task.objects.get(pk=long).output_tail == "working\n"
    # R1: again in a sync, and alone, the first answers; nothing applied twice.
    again = sync(machine, receipts=receipts).json()
    assert again == {"leases": [], "receipts": got["receipts"]}
    alone = machine_api(machine).post("/api/worker/receipts/", receipts[1], format="json")
    assert (alone.status_code, alone.json()) == (200, {"outcome": "applied"})
    assert Receipt.objects.filter(machine=machine).count() == 3
    # and a receipt first sent alone answers the same inside a sync
    alone_first = receipt(machine, long, "final", final_facts(exit_code=1), event_id="l-2")
    assert sync(machine, receipts=[body(machine, long, "final", final_facts(exit_code=1), "l-2")]).json()[
        "receipts"] == [{"event_id": "l-2", "status": 200, "answer": alone_first.json()}]


def test_l5_sync_answers_each_renewal_on_its_own(owner, other_owner, machine, grant, make_machine, pinned):
    """A cancelled task's renewal is refused (409 ``cancelled``, L5), another machine's
    lease and an unknown one are 404, a receipt for another machine's operation is 404
    (not stored); the good lease is renewed all the same."""
    from tasks_app.models import Grant

    good, good_lease = leased(owner, machine, grant.path)
    cancelled, cancelled_lease = leased(owner, machine, grant.path)
    assert owner_api(owner).post(f"/api/tasks/{cancelled}/cancel/").status_code == 200
    theirs = make_machine(other_owner, "theirs")
    their_grant = Grant.objects.create(owner=other_owner, machine=theirs, path=grant.path + "-theirs")
    their_task, their_lease = leased(other_owner, theirs, their_grant.path)
    nobody = str(uuid.uuid4())
    pinned.shift(10)
    got = sync(machine, renew=[{"lease_id": cancelled_lease}, {"lease_id": their_lease}, {"lease_id": nobody},
                               {"lease_id": good_lease}],
               receipts=[body(machine, their_task, "running", RUNNING, "x-1")]).json()
    assert [(a["status"], a.get("error")) for a in got["leases"]] == [
        (409, "cancelled"), (404, "not_found"), (404, "not_found"), (200, None)]
    assert got["receipts"] == [{"event_id": "x-1", "status": 404, "answer": {
        "error": "not_found", "detail": "no such operation for this machine"}}]
    assert Lease.objects.get(pk=their_lease).renewals == 0
    assert Lease.objects.get(pk=good_lease).renewals == 1
    assert not Receipt.objects.filter(event_id="x-1").exists()


@pytest.mark.parametrize("bad, field", [
    ({"receipts": "many"}, "receipts"),
    ({"renew": [{"lease_id": "x"}]}, "renew"),
    ({}, "non_field_errors"),
    ({"renew": [], "receipts": []}, "non_field_errors"),
    ({"renew": [{"lease_id": str(uuid.uuid4())}] * 101}, "renew"),
])
def test_k3_a_malformed_sync_is_refused_whole_and_changes_nothing(owner, machine, grant, pinned, bad, field):
    task_id, lease_id = leased(owner, machine, grant.path)
    before = table_digest()
    answer = sync(machine, **bad)
    assert (answer.status_code, answer.json()["error"]) == (400, "invalid")
    assert field in answer.json()["fields"], answer.json()
    # one good receipt beside a malformed one: neither is applied
    mixed = sync(machine, renew=[{"lease_id": lease_id}],
                 receipts=[body(machine, task_id, "running", RUNNING, "ok-1"),
                           body(machine, task_id, "final", {"process_started": "perhaps"}, "bad-1")])
    assert mixed.status_code == 400
    assert table_digest() == before


def test_l2_a_renewal_sync_runs_as_many_statements_for_eight_leases_as_for_one(owner, machine, grant, pinned):
    """Issue 44: a machine's traffic scales with machines, not tasks. The renewals of one
    sync share one transaction and one statement per kind of row (machine, grants, budget,
    tasks, leases, the renewal's write), so eight leases cost what one does."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    leases = [leased(owner, machine, grant.path)[1] for _ in range(8)]
    pinned.shift(10)
    sync(machine, renew=[{"lease_id": leases[0]}])  # the machine's first word records it heard (P2)
    counts = []
    for renew in ([{"lease_id": leases[0]}], [{"lease_id": lease} for lease in leases]):
        with CaptureQueriesContext(connection) as queries:
            got = sync(machine, renew=renew)
        assert [a["status"] for a in got.json()["leases"]] == [200] * len(renew)
        counts.append(len(queries))
    assert counts[0] == counts[1], counts
    assert sorted(Lease.objects.filter(pk__in=leases).values_list("renewals", flat=True)) == [1] * 7 + [3]


def test_l6_an_expired_lease_in_a_sync_expires_alone_and_the_others_are_renewed(owner, machine, grant, pinned):
    """One lease of the sync is past ``expires_at``: it is refused ``expired`` and its task
    becomes ``unknown`` (L6); the other lease, granted later, is renewed from now (L2), in
    the same request."""
    old_task, old_lease = leased(owner, machine, grant.path)
    pinned.shift(40)
    young_task, young_lease = leased(owner, machine, grant.path)
    pinned.shift(21)  # the old lease (60 s) is past its end, the young one has 39 s left
    got = sync(machine, renew=[{"lease_id": old_lease}, {"lease_id": young_lease}]).json()
    assert [(a["status"], a.get("error")) for a in got["leases"]] == [(409, "expired"), (200, None)]
    assert Task.objects.get(pk=old_task).state == "unknown"
    assert Lease.objects.get(pk=old_lease).end_reason == "expired"
    young = Lease.objects.get(pk=young_lease)
    assert (young.renewals, young.expires_at.timestamp()) == (1, clock.now().timestamp() + 60)
    assert Task.objects.get(pk=young_task).state in ("starting", "running")
