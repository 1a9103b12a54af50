"""Queued follow-ups on the service (SPEC G8, section 2 ``queued``, A1-A8, J5, J7, P2, P3):
a ``continue_task`` naming an unfinished task is accepted in ``queued`` behind it
(holding no budget, no folder lock, no start window and no ``start`` message), becomes
``accepted`` with its ``start`` message in the transaction that makes the first final,
resumes the first's agent session, runs in the order accepted; cancel cascades; a first
task without an agent session id refuses the chain ``resume_unavailable``; a refusal at
promotion ends it ``not_started``; revocation ends queued tasks at once; integrate waits
for a follow-up on the branch. The worker side (the session resumed, the same worktree
and branch) is tests/test_g8_followups_live.py."""
import uuid

import pytest
from django.db import connection
from django.utils import timezone

from tasks_app.models import Budget, Grant, OutboxMessage, Task, TaskEvent
from tasks_app.services.revocation import grant_revoke, machine_unpair
from tasks_app.services.sweeps import expire_start_windows
from tests.barrier import race
from tests.conftest import owner_api
from tests.factories import agent_facts, final_facts, grant_lease, receipt, submit

pytestmark = pytest.mark.django_db

SESSION_1 = "11111111-1111-4111-8111-111111111111"
SESSION_2 = "22222222-2222-4222-8222-222222222222"


def running(owner, machine, folder, **extra) -> str:
    resp = submit(owner, machine, folder, **extra)
    assert resp.status_code == 201, resp.content
    task_id = resp.json()["id"]
    assert grant_lease(machine, task_id).status_code == 201
    receipt(machine, task_id, "running", {"pid": 10, "pgid": 10, "process_start_time": 1.0})
    return task_id


def succeed(machine, task_id, session=SESSION_1, **facts) -> None:
    resp = receipt(machine, task_id, "final", final_facts(**{**agent_facts(agent_session_id=session), **facts}))
    assert resp.json() == {"outcome": "applied"}, resp.content


def follow_up(owner, machine, folder, task_id, **extra):
    return submit(owner, machine, folder, continue_task=task_id, agent="claude", **extra)


def starts(task_id) -> list[OutboxMessage]:
    return list(OutboxMessage.objects.filter(operation__task_id=task_id, kind="start"))


def state(task_id) -> str:
    return Task.objects.get(pk=task_id).state


def test_g8_a_follow_up_of_a_running_task_is_queued_then_accepted_with_its_start_when_the_first_succeeds(
        owner, machine, grant, grant_root, pinned):
    first = running(owner, machine, grant_root / "a")
    key = f"follow-{uuid.uuid4()}"
    resp = follow_up(owner, machine, grant_root / "b", first, key=key)
    assert resp.status_code == 201, resp.content
    body = resp.json()
    assert (body["state"], body["queued_behind"], body["continue_task"]) == ("queued", first, first)
    assert (body["reserved_s"], body["holds_lock"]) == (0, False)
    queued = Task.objects.get(pk=body["id"])
    assert queued.accepted_at is None and starts(queued.pk) == []  # no start message, no start window
    assert Budget.objects.get(owner=owner).reserved_s == 1800  # the first's only
    # A2: the same key replays the queued answer byte-equal; nothing else is created.
    again = follow_up(owner, machine, grant_root / "b", first, key=key)
    assert again.content == resp.content and again.headers["Idempotent-Replayed"] == "true"
    assert Task.objects.count() == 2

    pinned.shift(300)
    succeed(machine, first)
    queued.refresh_from_db()
    assert queued.state == "accepted" and queued.holds_lock and queued.reserved_s == 1800
    assert queued.accepted_at == Task.objects.get(pk=first).final_at  # the same transaction
    [start] = starts(queued.pk)
    assert start.payload["agent_session_id"] == SESSION_1  # G6: resumes the first's session
    assert start.payload["prompt"] == "do it" and start.payload["folder"] == str(grant_root / "b")
    assert Budget.objects.get(owner=owner).reserved_s == 1800  # the first's released, the follow-up's taken
    reasons = list(TaskEvent.objects.filter(task=queued).values_list("old_state", "new_state"))
    assert reasons == [("", "queued"), ("queued", "accepted")]
    detail = owner_api(owner).get(f"/api/tasks/{queued.pk}/").json()
    assert (detail["state"], detail["queued_behind"]) == ("accepted", first)  # kept as history


def test_g8_several_follow_ups_run_one_after_another_in_the_order_accepted(owner, machine, grant, grant_root, pinned):
    first = running(owner, machine, grant_root, exclusive=False)
    f1 = follow_up(owner, machine, grant_root, first, exclusive=False).json()
    f2 = follow_up(owner, machine, grant_root, first, exclusive=False).json()  # naming the first again
    f3 = follow_up(owner, machine, grant_root, f1["id"], exclusive=False).json()  # or any link of the chain
    assert [f["queued_behind"] for f in (f1, f2, f3)] == [first, f1["id"], f2["id"]]
    assert {f["state"] for f in (f1, f2, f3)} == {"queued"}

    succeed(machine, first, session=SESSION_1)
    assert [state(f["id"]) for f in (f1, f2, f3)] == ["accepted", "queued", "queued"]
    assert grant_lease(machine, f1["id"]).status_code == 201
    succeed(machine, f1["id"], session=SESSION_2)
    assert [state(f["id"]) for f in (f1, f2, f3)] == ["succeeded", "accepted", "queued"]
    assert starts(f2["id"])[0].payload["agent_session_id"] == SESSION_2  # the session as it is now
    # A follow-up naming a task whose next one already runs waits behind that one.
    f4 = follow_up(owner, machine, grant_root, first, exclusive=False).json()
    assert (f4["state"], f4["queued_behind"]) == ("queued", f3["id"])


def test_g8_a_queued_task_holds_no_budget_and_no_folder_lock(owner, machine, grant, grant_root, pinned):
    Budget.objects.filter(owner=owner).update(limit_s=2 * 1800)
    first = running(owner, machine, grant_root / "a")
    queued = follow_up(owner, machine, grant_root / "b", first).json()
    assert queued["state"] == "queued"
    # Neither its folder nor its budget is taken: a plain task takes both.
    plain = submit(owner, machine, grant_root / "b")
    assert plain.status_code == 201, plain.content
    assert Budget.objects.get(owner=owner).reserved_s == 2 * 1800
    # A6 at its turn: the folder is locked by the plain task -> not_started with the reason.
    succeed(machine, first)
    task = Task.objects.get(pk=queued["id"])
    assert task.state == "not_started" and task.state_reason.startswith("folder_locked")
    assert task.reserved_s == 0 and not task.holds_lock and starts(task.pk) == []
    assert Budget.objects.get(owner=owner).reserved_s == 1800  # the plain task's


def test_g8_a_refusal_at_its_turn_ends_it_not_started_and_the_chain_resume_unavailable(
        owner, machine, grant, grant_root, pinned):
    first = running(owner, machine, grant_root, exclusive=False)
    f1 = follow_up(owner, machine, grant_root, first, exclusive=False).json()
    f2 = follow_up(owner, machine, grant_root, first, exclusive=False).json()
    Budget.objects.filter(owner=owner).update(spent_s=36000 - 100)  # nothing left for 1800 s
    succeed(machine, first)
    one, two = Task.objects.get(pk=f1["id"]), Task.objects.get(pk=f2["id"])
    assert (one.state, one.state_reason.split(":")[0]) == ("not_started", "budget_exhausted")
    assert one.facts == {"process_started": False, "refused_reason": "budget_exhausted"}
    assert (two.state, two.facts["refused_reason"]) == ("not_started", "resume_unavailable")
    assert starts(one.pk) == starts(two.pk) == []
    assert Budget.objects.get(owner=owner).reserved_s == 0


def test_g8_a_first_task_without_an_agent_session_id_refuses_its_follow_ups_resume_unavailable(
        owner, machine, grant, grant_root, pinned):
    first = running(owner, machine, grant_root, exclusive=False)
    f1 = follow_up(owner, machine, grant_root, first, exclusive=False).json()
    f2 = follow_up(owner, machine, grant_root, first, exclusive=False).json()
    receipt(machine, first, "final", final_facts())  # succeeded, but no agent session id
    for f in (f1, f2):
        task = Task.objects.get(pk=f["id"])
        assert task.state == "not_started"
        assert task.facts == {"process_started": False, "refused_reason": "resume_unavailable"}
        assert task.state_reason.startswith("resume_unavailable")
        assert starts(task.pk) == []
    detail = owner_api(owner).get(f"/api/tasks/{f1['id']}/").json()
    assert detail["state"] == "not_started" and "resume_unavailable" in detail["state_reason"]


def test_g8_cancel_cascades_down_the_chain(owner, machine, grant, grant_root, pinned):
    api = owner_api(owner)
    first = running(owner, machine, grant_root, exclusive=False)
    f1, f2, f3 = (follow_up(owner, machine, grant_root, first, exclusive=False).json()["id"] for _ in range(3))
    # Cancelling a queued task cancels it at once, and everything queued behind it.
    resp = api.post(f"/api/tasks/{f2}/cancel/", {}, format="json")
    assert resp.status_code == 200 and resp.json()["state"] == "cancelled"
    assert [state(t) for t in (first, f1, f2, f3)] == ["running", "queued", "cancelled", "cancelled"]
    assert api.post(f"/api/tasks/{f3}/cancel/", {}, format="json").json()["error"] == "already_final"
    # Cancelling the first (leased: only requested, J7) cancels its queued follow-ups now.
    assert api.post(f"/api/tasks/{first}/cancel/", {}, format="json").status_code == 200
    assert [state(t) for t in (first, f1)] == ["running", "cancelled"]
    assert Task.objects.get(pk=first).cancel_requested_at is not None
    # Even if its facts then say it succeeded, nothing of the chain runs.
    succeed(machine, first)
    assert state(f1) == "cancelled" and starts(f1) == []


def test_g8_a_first_task_cancelled_by_its_facts_cancels_its_follow_ups(owner, machine, grant, grant_root, pinned):
    first = submit(owner, machine, grant_root, exclusive=False).json()["id"]  # never leased
    f1 = follow_up(owner, machine, grant_root, first, exclusive=False).json()["id"]
    f2 = follow_up(owner, machine, grant_root, first, exclusive=False).json()["id"]
    assert owner_api(owner).post(f"/api/tasks/{first}/cancel/", {}, format="json").json()["state"] == "cancelled"
    assert [state(t) for t in (f1, f2)] == ["cancelled", "cancelled"]
    leased = running(owner, machine, grant_root, exclusive=False)
    f3 = follow_up(owner, machine, grant_root, leased, exclusive=False).json()["id"]
    succeed(machine, leased, stop_reason="cancel")  # J6 row 3: cancelled (by the worker's stop)
    assert (state(leased), state(f3)) == ("cancelled", "cancelled")


def test_g8_unknown_keeps_follow_ups_queued_until_the_owner_decides(owner, machine, grant, grant_root, pinned):
    from tasks_app.services.decisions import task_decide

    first = running(owner, machine, grant_root, exclusive=False)
    f1 = follow_up(owner, machine, grant_root, first, exclusive=False).json()["id"]
    receipt(machine, first, "unknown", {"reason": "lost track"})
    assert (state(first), state(f1)) == ("unknown", "queued")
    # A report with the agent's session id but no final facts leaves it unknown (U2).
    Task.objects.filter(pk=first).update(agent_session_id=SESSION_1)
    task_decide(task=Task.objects.get(pk=first), decision="succeeded", user=owner, now=timezone.now())
    assert state(f1) == "accepted" and starts(f1)[0].payload["agent_session_id"] == SESSION_1


def test_g8_start_window_opens_at_promotion(owner, machine, grant, grant_root, pinned, settings):
    first = running(owner, machine, grant_root, exclusive=False)
    f1 = follow_up(owner, machine, grant_root, first, exclusive=False).json()["id"]
    pinned.shift(settings.RUNSTEAD_START_WINDOW_S + 60)  # the first ran longer than a start window
    assert expire_start_windows(now=timezone.now()) == 0  # queued: no window yet
    succeed(machine, first)
    pinned.shift(settings.RUNSTEAD_START_WINDOW_S - 60)
    assert expire_start_windows(now=timezone.now()) == 0 and state(f1) == "accepted"
    pinned.shift(120)
    assert expire_start_windows(now=timezone.now()) == 1 and state(f1) == "not_started"


def test_g8_no_lease_and_no_receipt_while_queued(owner, machine, grant, grant_root, pinned):
    first = running(owner, machine, grant_root, exclusive=False)
    f1 = follow_up(owner, machine, grant_root, first, exclusive=False).json()["id"]
    resp = grant_lease(machine, f1)
    assert resp.status_code == 409 and resp.json()["error"] in ("budget", "queued")  # holds no reservation either
    assert not Task.objects.get(pk=f1).leases.exists()
    assert receipt(machine, f1, "final", final_facts()).json() == {"outcome": "not_applied", "reason": "state"}
    assert state(f1) == "queued"


def test_g8_p3_unpairing_or_revoking_ends_queued_follow_ups_at_once(owner, machine, grant, grant_root, pinned):
    first = running(owner, machine, grant_root, exclusive=False)
    f1 = follow_up(owner, machine, grant_root, first, exclusive=False).json()["id"]
    f2 = follow_up(owner, machine, grant_root, first, exclusive=False).json()["id"]
    grant_revoke(grant=Grant.objects.get(pk=grant.pk), actor="test", now=timezone.now())
    assert [state(t) for t in (first, f1, f2)] == ["running", "not_started", "not_started"]
    assert all("grant revoked" in TaskEvent.objects.filter(task_id=t).last().reason for t in (f1, f2))

    other_grant = Grant.objects.create(owner=owner, machine=machine, path=str(grant_root / "other"))
    second = running(owner, machine, other_grant.path, exclusive=False)
    f3 = follow_up(owner, machine, other_grant.path, second, exclusive=False).json()["id"]
    machine_unpair(machine=machine, actor="test", now=timezone.now())
    assert state(f3) == "not_started" and "machine unpaired" in TaskEvent.objects.filter(task_id=f3).last().reason


def test_g8_bad_follow_ups_get_the_same_400_as_g6(owner, other_owner, machine, grant, grant_root, make_machine, pinned):
    theirs_machine = make_machine(other_owner, name="theirs")
    theirs_grant = Grant.objects.create(owner=other_owner, machine=theirs_machine, path=str(grant_root))
    theirs_running = running(other_owner, theirs_machine, theirs_grant.path)
    desk = make_machine(owner, name="desk")
    Grant.objects.create(owner=owner, machine=desk, path=str(grant_root))
    mine_elsewhere = running(owner, desk, grant_root, exclusive=False)
    before = Task.objects.count()
    answers = [follow_up(owner, machine, grant_root, target, exclusive=False) for target in (theirs_running, mine_elsewhere)]
    assert {(a.status_code, a.json()["error"]) for a in answers} == {(400, "continue_invalid")}
    assert len({a.json()["detail"] for a in answers}) == 1
    assert Task.objects.count() == before and Task.objects.filter(state="queued").count() == 0


# --- G7 + G8: a follow-up of a worktree task works on its branch -------------------------------

def worktree_final(owner, machine, folder, **extra) -> str:
    task_id = running(owner, machine, folder, isolation="worktree", **extra)
    succeed(machine, task_id, evidence={"git": {
        "start_head": "a" * 40, "end_head": "b" * 40, "commits": 1, "subjects": ["x"], "files_changed": 1,
        "insertions": 1, "deletions": 0, "dirty": [], "dirty_count": 0, "start_dirty": 0,
        "branch": f"runstead/{task_id[:8]}", "base": "a" * 40, "base_branch": "main", "files": [], "diff": "",
        "truncated": False}})
    return task_id


def integrate(owner, task_id, action="merge"):
    return owner_api(owner).post(f"/api/tasks/{task_id}/integrate/", {"action": action}, format="json",
                                 HTTP_IDEMPOTENCY_KEY=str(uuid.uuid4()))


def test_g8_g7_a_follow_up_of_a_worktree_task_runs_on_its_branch_and_integrate_waits_for_it(
        owner, machine, grant, grant_root, pinned):
    first = running(owner, machine, grant_root, isolation="worktree")
    assert follow_up(owner, machine, grant_root, first, isolation="none").json()["error"] == "invalid"
    f1 = follow_up(owner, machine, grant_root, first).json()
    assert (f1["state"], f1["isolation"], f1["holds_lock"]) == ("queued", "worktree", False)
    succeed(machine, first, evidence={"git": {
        "start_head": "a" * 40, "end_head": "b" * 40, "commits": 1, "subjects": ["x"], "files_changed": 1,
        "insertions": 1, "deletions": 0, "dirty": [], "dirty_count": 0, "start_dirty": 0,
        "branch": f"runstead/{first[:8]}", "base": "a" * 40, "base_branch": "main", "files": [], "diff": "",
        "truncated": False}})
    [start] = starts(f1["id"])
    first_operation = str(Task.objects.get(pk=first).operation.id)
    assert start.payload["worktree_of"] == first_operation and start.payload["isolation"] == "worktree"
    # The first's branch is the follow-up's too: no decision while the follow-up is unfinished.
    resp = integrate(owner, first)
    assert (resp.status_code, resp.json()["error"], resp.json()["task_id"]) == (409, "follow_up_pending", f1["id"])
    assert grant_lease(machine, f1["id"]).status_code == 201
    succeed(machine, f1["id"], session=SESSION_2, evidence={"git": {
        "start_head": "b" * 40, "end_head": "c" * 40, "commits": 1, "subjects": ["y"], "files_changed": 1,
        "insertions": 1, "deletions": 0, "dirty": [], "dirty_count": 0, "start_dirty": 0,
        "branch": f"runstead/{first[:8]}", "base": "a" * 40, "base_branch": "main", "files": [], "diff": "",
        "truncated": False}})
    resp = integrate(owner, first)
    assert (resp.status_code, resp.json()["error"], resp.json()["task_id"]) == (409, "superseded", f1["id"])
    resp = integrate(owner, f1["id"])
    assert resp.status_code == 202, resp.content
    integrate_message = OutboxMessage.objects.get(operation__task_id=f1["id"], kind="integrate")
    assert integrate_message.payload["head"] == "c" * 40
    assert integrate(owner, first).json()["error"] == "already_decided"
    # Once decided, the branch takes no more follow-ups.
    late = follow_up(owner, machine, grant_root, f1["id"])
    assert (late.status_code, late.json()["error"]) == (400, "continue_invalid")


def test_g8_g7_a_g6_follow_up_of_a_final_worktree_task_also_runs_on_its_branch(owner, machine, grant, grant_root,
                                                                                pinned):
    first = worktree_final(owner, machine, grant_root)
    resp = follow_up(owner, machine, grant_root, first)
    assert resp.status_code == 201 and resp.json()["state"] == "accepted"
    assert starts(resp.json()["id"])[0].payload["worktree_of"] == str(Task.objects.get(pk=first).operation.id)
    assert Task.objects.get(pk=resp.json()["id"]).branch_of_id == uuid.UUID(first)


# --- P2: a follow-up accepted while the first's final receipt lands ----------------------------

@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_g8_p2_follow_up_racing_the_first_tasks_final_receipt_never_waits_behind_a_final_task(
        owner, machine, grant, grant_root, settings):
    """The follow-up's acceptance and the first's final receipt, released together, 12
    rounds: whichever commits first, the follow-up ends up ``accepted`` with exactly one
    ``start`` message carrying the first's session id (queued then promoted, or accepted
    directly as a G6 follow-up), never ``queued`` behind a final task."""
    settings.RUNSTEAD_ACCEPT_RATE = "100000/min"
    assert connection.vendor == "postgresql"
    paths = {"queued": 0, "direct": 0}
    for i in range(12):
        first = running(owner, machine, grant_root, exclusive=False)

        def work(n):
            if n == 0:
                return follow_up(owner, machine, grant_root, first, exclusive=False)
            return receipt(machine, first, "final", final_facts(**agent_facts(agent_session_id=SESSION_1)))

        accepted, final = race(2, work)
        assert accepted.status_code == 201, accepted.content
        assert final.json() == {"outcome": "applied"}
        task = Task.objects.get(pk=accepted.json()["id"])
        assert state(first) == "succeeded"
        assert task.state == "accepted", (i, task.state)
        [start] = starts(task.pk)
        assert start.payload["agent_session_id"] == SESSION_1
        paths["queued" if accepted.json()["state"] == "queued" else "direct"] += 1
        history = list(TaskEvent.objects.filter(task=task).values_list("new_state", flat=True))
        assert history in (["queued", "accepted"], ["accepted"])
        assert Task.objects.filter(state="queued").count() == 0
    assert Budget.objects.get(owner=owner).reserved_s == 12 * 1800  # each follow-up's reservation, once
    assert sum(paths.values()) == 12


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_g8_p2_cancel_of_the_first_racing_a_follow_up_leaves_no_follow_up_queued_behind_a_final_task(
        owner, machine, grant, grant_root, settings):
    """A never-leased first task cancelled while a follow-up of it is accepted: the
    follow-up is either refused (it named a final task without a session id: 400) or
    cancelled with the chain; never left queued."""
    settings.RUNSTEAD_ACCEPT_RATE = "100000/min"
    for _ in range(8):
        first = submit(owner, machine, grant_root, exclusive=False).json()["id"]
        results = race(2, lambda n: follow_up(owner, machine, grant_root, first, exclusive=False) if n == 0 else
                       owner_api(owner).post(f"/api/tasks/{first}/cancel/", {}, format="json"))
        accepted, cancelled = results
        assert cancelled.status_code == 200 and state(first) == "cancelled"
        if accepted.status_code == 201:
            assert state(accepted.json()["id"]) == "cancelled"
        else:
            assert accepted.json()["error"] == "continue_invalid"
    assert Task.objects.filter(state="queued").count() == 0
