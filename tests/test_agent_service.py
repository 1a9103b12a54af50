"""The service's side of real agents (SPEC G3, G4, G5, G6, H): agent facts stored on the
task and carried by Task JSON, malformed ones refused (K3), live progress kept bounded
with its seq rule and pushed as ``task.progress``, and follow-ups validated."""
import pytest

from tasks_app.models import OutboxMessage, Task
from tests.conftest import machine_api, owner_api
from tests.factories import agent_facts, final_facts, grant_lease, operation_id, receipt, submit
from tests.sessions_events import board_events  # noqa: F401  (fixture)

pytestmark = pytest.mark.django_db

AGENT = agent_facts()


def running(owner, machine, folder, **extra) -> str:
    task_id = submit(owner, machine, folder, **extra).json()["id"]
    assert grant_lease(machine, task_id).status_code == 201
    receipt(machine, task_id, "running", {"pid": 10, "pgid": 10, "process_start_time": 1.0})
    return task_id


def finished(owner, machine, folder, **facts) -> str:
    task_id = running(owner, machine, folder)
    resp = receipt(machine, task_id, "final", final_facts(**{**AGENT, **facts}))
    assert resp.json() == {"outcome": "applied"}, resp.content
    return task_id


# --- G3 / G5: facts on the task ---------------------------------------------------------------

def test_g3_final_agent_facts_are_stored_and_in_task_json(owner, machine, grant, grant_root, pinned):
    task_id = finished(owner, machine, grant_root)
    body = owner_api(owner).get(f"/api/tasks/{task_id}/").json()
    assert body["state"] == "succeeded"
    assert body["agent_result"] == AGENT["agent_result"]
    assert body["usage"] == AGENT["usage"]
    assert body["agent_session_id"] == AGENT["agent_session_id"]
    assert body["evidence"] == AGENT["evidence"]
    task = Task.objects.get(pk=task_id)
    assert (task.agent_session_id, task.evidence["git"]["commits"]) == (AGENT["agent_session_id"], 2)


def test_g3_task_without_agent_facts_has_nulls(owner, machine, grant, grant_root, pinned):
    task_id = running(owner, machine, grant_root)
    receipt(machine, task_id, "final", final_facts())
    body = owner_api(owner).get(f"/api/tasks/{task_id}/").json()
    assert (body["agent_result"], body["usage"], body["agent_session_id"], body["evidence"], body["progress"]) == (
        None, None, None, {}, None)


@pytest.mark.parametrize("bad", [
    {"usage": {"turns": "3"}},
    {"usage": {"turns": 1, "tokens": 2}},
    {"usage": {"turns": -1}},
    {"agent_result": {"subtype": "success"}},
    {"agent_result": {"is_error": "yes", "subtype": "x", "summary": ""}},
    {"agent_session_id": 7},
    {"agent_session_id": "x" * 201},
    {"refused_reason": "bored"},
    {"evidence": {"git": {"commits": "2"}}},
    {"evidence": {"svn": {}}},
], ids=lambda b: next(iter(b)))
def test_k3_malformed_agent_facts_are_refused(owner, machine, grant, grant_root, pinned, bad):
    task_id = running(owner, machine, grant_root)
    resp = receipt(machine, task_id, "final", final_facts(**bad))
    assert resp.status_code == 400, resp.content
    assert Task.objects.get(pk=task_id).state == "running"  # nothing changed


def test_g5_report_with_final_facts_carries_git_evidence(owner, machine, grant, grant_root, pinned):
    """U1/U2: the report's record.final settles the task and brings its evidence."""
    task_id = running(owner, machine, grant_root)
    pinned.shift(61)
    from core import clock
    from tasks_app.services.sweeps import expire_leases
    assert expire_leases(now=clock.now()) == 1
    query = OutboxMessage.objects.get(operation__task_id=task_id, kind="query")
    record = {"local_state": "ended", "pid": 10, "lease_id": None, "final": final_facts(**AGENT)}
    resp = receipt(machine, task_id, "report", {"query_id": query.payload["query_id"], "record": record})
    assert resp.json() == {"outcome": "applied"}
    task = Task.objects.get(pk=task_id)
    assert task.state == "succeeded" and task.evidence == AGENT["evidence"]


# --- G4: progress ----------------------------------------------------------------------------

def progress(machine, task_id, seq, **extra):
    body = {"operation_id": operation_id(task_id), "seq": seq, "output_tail": "line\n", "last_message": "Working.",
            "usage": {"turns": seq, "tool_calls": 0, "input_tokens": 1, "output_tokens": 1, "cost_usd": None}, **extra}
    return machine_api(machine).post("/api/worker/progress/", body, format="json")


def test_g4_progress_is_kept_and_pushed_as_task_progress(owner, machine, grant, grant_root, pinned, board_events,  # noqa: F811
                                                         django_capture_on_commit_callbacks):
    task_id = running(owner, machine, grant_root)
    version = Task.objects.get(pk=task_id).version
    board_events.clear()
    with django_capture_on_commit_callbacks(execute=True):
        resp = progress(machine, task_id, 1)
    assert resp.status_code == 200 and resp.json() == {"outcome": "applied"}
    task = Task.objects.get(pk=task_id)
    assert task.state == "running"  # never a state change
    assert task.version == version + 1
    expected = {"seq": 1, "at": pinned_iso(), "last_message": "Working.", "output_tail": "line\n",
                "usage": {"turns": 1, "tool_calls": 0, "input_tokens": 1, "output_tokens": 1, "cost_usd": None},
                "entries": []}
    assert task.progress == expected
    (event,) = [e for e in board_events.of(owner) if e["type"] == "task.progress"]
    assert event == {"type": "task.progress", "task_id": task_id, "progress": expected, "version": version + 1,
                     "server_time": event["server_time"]}
    assert owner_api(owner).get(f"/api/tasks/{task_id}/").json()["progress"] == expected


def pinned_iso():
    from core import clock
    return clock.now().isoformat()


def test_g4_seq_not_above_the_last_is_ignored(owner, machine, grant, grant_root, pinned, board_events,  # noqa: F811
                                              django_capture_on_commit_callbacks):
    task_id = running(owner, machine, grant_root)
    assert progress(machine, task_id, 5).json() == {"outcome": "applied"}
    board_events.clear()
    with django_capture_on_commit_callbacks(execute=True):
        for seq in (5, 4):
            assert progress(machine, task_id, seq, last_message="old").json() == {"outcome": "not_applied",
                                                                               "reason": "stale_seq"}
    assert Task.objects.get(pk=task_id).progress["seq"] == 5
    assert Task.objects.get(pk=task_id).progress["last_message"] == "Working."
    assert [e for e in board_events.of(owner) if e["type"] == "task.progress"] == []


def test_g4_progress_for_a_final_task_is_refused(owner, machine, grant, grant_root, pinned):
    task_id = finished(owner, machine, grant_root)
    assert progress(machine, task_id, 1).json() == {"outcome": "not_applied", "reason": "final"}
    assert Task.objects.get(pk=task_id).progress is None


def test_g4_progress_is_bounded(owner, machine, grant, grant_root, pinned):
    task_id = running(owner, machine, grant_root)
    assert progress(machine, task_id, 1, output_tail="t" * 10000, last_message="é" * 5000).status_code == 200
    stored = Task.objects.get(pk=task_id).progress
    assert len(stored["output_tail"]) <= 4000 and len(stored["last_message"].encode()) <= 4096


def test_k2_progress_for_another_machines_operation_is_404(owner, machine, grant, grant_root, pinned, make_machine):
    task_id = running(owner, machine, grant_root)
    other = make_machine(owner, name="other")
    body = {"operation_id": operation_id(task_id), "seq": 1, "output_tail": "", "last_message": None, "usage": None}
    assert machine_api(other).post("/api/worker/progress/", body, format="json").status_code == 404


@pytest.mark.parametrize("bad", [{"seq": "1"}, {"seq": 0}, {"extra": 1}, {"usage": {"turns": "x"}},
                                 {"output_tail": None}], ids=str)
def test_k3_malformed_progress_is_refused(owner, machine, grant, grant_root, pinned, bad):
    task_id = running(owner, machine, grant_root)
    body = {"operation_id": operation_id(task_id), "seq": 1, "output_tail": "", "last_message": None, "usage": None,
            **bad}
    resp = machine_api(machine).post("/api/worker/progress/", body, format="json")
    assert resp.status_code == 400 and resp.json()["error"]
    assert Task.objects.get(pk=task_id).progress is None


# --- G6: follow-ups ------------------------------------------------------------------------

def test_g6_follow_up_start_payload_carries_the_agent_session_id(owner, machine, grant, grant_root, pinned):
    first = finished(owner, machine, grant_root)
    resp = submit(owner, machine, grant_root, continue_task=first, agent="claude")
    assert resp.status_code == 201, resp.content
    assert resp.json()["continue_task"] == first
    start = OutboxMessage.objects.get(operation__task_id=resp.json()["id"], kind="start")
    assert start.payload["agent_session_id"] == AGENT["agent_session_id"]
    plain = OutboxMessage.objects.get(operation__task_id=first, kind="start")
    assert "agent_session_id" not in plain.payload


def test_g6_invalid_follow_ups_get_the_same_400(owner, other_owner, machine, grant, grant_root, make_machine, pinned):
    """Only a task of the same owner and machine can be followed; a final one must carry an
    agent session id. (An unfinished one is fine since G8: the follow-up is queued,
    tests/test_g8_queued_followups.py.)"""
    from tests.conftest import owner_api as api
    no_session = running(owner, machine, grant_root)
    receipt(machine, no_session, "final", final_facts())  # final, but no agent session id
    unfinished_elsewhere = submit(owner, machine, grant_root, exclusive=False).json()["id"]
    other_machine = make_machine(owner, name="desk")
    elsewhere = finished(owner, machine, grant_root)
    theirs_machine = make_machine(other_owner, name="theirs")
    from tasks_app.models import Grant
    theirs_grant = Grant.objects.create(owner=other_owner, machine=theirs_machine, path=str(grant_root))
    theirs = finished(other_owner, theirs_machine, theirs_grant.path)
    answers = []
    for target, on_machine in ((no_session, machine), (unfinished_elsewhere, other_machine), (elsewhere, other_machine),
                               (theirs, machine), ("00000000-0000-0000-0000-000000000000", machine)):
        if on_machine is other_machine:
            Grant.objects.get_or_create(owner=owner, machine=other_machine, path=str(grant_root))
        resp = submit(owner, on_machine, grant_root, continue_task=target, exclusive=False)
        answers.append((resp.status_code, resp.json()))
    assert {a[0] for a in answers} == {400}
    assert {a[1]["error"] for a in answers} == {"continue_invalid"}
    assert len({a[1]["detail"] for a in answers}) == 1  # the same answer: ids leak nothing
    assert api(owner).post("/api/tasks/", {"machine": str(machine.id), "folder": str(grant_root), "agent": "a",
                                           "prompt": "p", "continue_task": 7}, format="json",
                           HTTP_IDEMPOTENCY_KEY="k-int").status_code == 400
