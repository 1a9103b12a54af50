"""The service <-> worker protocol written once (SPEC H, W2, J1, U1, G7, C2-C5; STYLE 18):
every message kind the service writes is its shape in ``machine.protocol.shapes``, the
worker's receipts are theirs, and a field one side sends that the shape does not name (or
a required one it leaves out) fails on both sides: the service's writer refuses to write
it, the worker's reader acknowledges and ignores it, the worker's receipt builder refuses
to build it. The receipt serializer names the same fields as ``ReceiptBody``."""
import threading
import uuid

import pytest

from machine.protocol.shapes import (
    PAYLOADS,
    RECEIPT_FACTS,
    RECEIPT_KINDS,
    RECEIPTS_PATH,
    ProtocolError,
    ReceiptBody,
    check_message,
    check_receipt,
)
from machine.worker.clock import FakeClock
from machine.worker.loop import WorkerOptions
from machine.worker.testing import InMemoryService
from machine.worker.wire import final_facts, receipt_item
from tasks_app.api.serializers import ReceiptSerializer
from tasks_app.models import MessageKind, OutboxMessage, Task
from tasks_app.services import transitions
from tests.conftest import machine_api, owner_api
from tests.factories import agent_facts, final_facts as service_final_facts, grant_lease, receipt, submit
from tests.worker_harness import count_lines, make_worker

RUNNING = {"pid": 7, "pgid": 7, "process_start_time": 1.0}
PROFILES = [{"name": "claude", "preset": "claude", "conversation": "live"},
            {"name": "wt", "preset": "claude", "isolation": "worktree"}, {"name": "demo", "preset": None}]
GIT = {"start_head": "a" * 40, "end_head": "b" * 40, "commits": 1, "subjects": ["x"], "files_changed": 1,
       "insertions": 1, "deletions": 0, "dirty": [], "dirty_count": 0, "start_dirty": 0,
       "branch": "runstead/abcd1234", "base": "a" * 40, "base_branch": "main",
       "files": [{"status": "M", "path": "a.py", "insertions": 1, "deletions": 0}], "diff": "", "truncated": False}


def running(machine, task_id) -> str:
    assert grant_lease(machine, task_id).status_code == 201
    assert receipt(machine, task_id, "running", RUNNING).json() == {"outcome": "applied"}
    return task_id


def created(response) -> str:
    assert response.status_code == 201, response.content
    return response.json()["id"]


def post(owner, path, body=None):
    response = owner_api(owner).post(path, body, format="json", HTTP_IDEMPOTENCY_KEY=str(uuid.uuid4()))
    assert response.status_code in (200, 201, 202), response.content
    return response


# --- the service writes each kind as its shape -------------------------------------------------------


@pytest.mark.django_db
def test_h_service_outbox_payloads_match_their_shapes(owner, machine, grant, grant_root, pinned):
    """Real tasks through the services write every message kind, each with every variant
    of ``start`` (plain, live conversation, follow-up in a worktree), and every payload is
    its kind's shape."""
    assert machine_api(machine).put("/api/worker/profiles/", {"profiles": PROFILES}, format="json").status_code == 200
    post(owner, f"/api/tasks/{running(machine, created(submit(owner, machine, grant_root / 'c')))}/cancel/")
    lost = running(machine, created(submit(owner, machine, grant_root / "u")))
    assert receipt(machine, lost, "unknown", {"reason": "worker_restart"}).json()["outcome"] == "applied"  # -> query
    live = running(machine, created(submit(owner, machine, grant_root / "l", agent="claude", mode="conversation",
                                           exclusive=False)))
    post(owner, f"/api/tasks/{live}/messages/", {"text": "and then?"})
    post(owner, f"/api/tasks/{live}/interrupt/")
    post(owner, f"/api/tasks/{live}/end/")
    first = running(machine, created(submit(owner, machine, grant_root / "w", agent="wt")))
    facts = service_final_facts(**agent_facts(agent_session_id="session-1", **GIT))
    assert receipt(machine, first, "final", facts).json() == {"outcome": "applied"}
    created(submit(owner, machine, grant_root / "w", agent="claude", continue_task=first))  # G6, G8: a follow-up
    decided = running(machine, created(submit(owner, machine, grant_root / "m", agent="wt")))
    assert receipt(machine, decided, "final", service_final_facts(evidence={"git": GIT})).json()["outcome"] == "applied"
    post(owner, f"/api/tasks/{decided}/integrate/", {"action": "merge"})
    session = {"id": str(uuid.uuid4()), "machine": str(machine.id), "channel": "terminal"}  # T1
    post(owner, "/api/sessions/", session)
    post(owner, f"/api/sessions/{session['id']}/messages/", {"text": "and you?"})  # T2
    post(owner, f"/api/sessions/{session['id']}/interrupt/")  # T5

    messages = list(OutboxMessage.objects.all())
    assert {m.kind for m in messages} == set(MessageKind.values) == set(PAYLOADS)
    for message in messages:
        assert check_message(message.kind, message.payload) is message.payload
    starts = [m.payload for m in messages if m.kind == "start"]
    assert any(p.get("mode") == "conversation" for p in starts)
    assert any(p.get("worktree_of") and p.get("agent_session_id") == "session-1" for p in starts)


@pytest.mark.django_db
def test_h_service_refuses_to_write_a_payload_that_is_not_its_shape(owner, machine, grant, grant_root, pinned,
                                                                      monkeypatch):
    """A builder that adds a field, or leaves out a required one, makes ``message_send``
    raise before anything is written; a field no builder takes is a TypeError."""
    task = Task.objects.get(pk=created(submit(owner, machine, grant_root)))
    count = OutboxMessage.objects.count()
    monkeypatch.setitem(transitions.BUILDERS, MessageKind.QUERY,
                        lambda task, query_id: {"operation_id": str(task.operation.id), "query_id": query_id, "x": 1})
    with pytest.raises(ProtocolError, match="QueryPayload: unknown field.s. x"):
        transitions.message_send(task, kind=MessageKind.QUERY, now=task.created_at, query_id="q")
    monkeypatch.setitem(transitions.BUILDERS, MessageKind.QUERY, lambda task, query_id: {"query_id": query_id})
    with pytest.raises(ProtocolError, match="missing field.s. operation_id"):
        transitions.message_send(task, kind=MessageKind.QUERY, now=task.created_at, query_id="q")
    with pytest.raises(TypeError):
        transitions.message_send(task, kind=MessageKind.CANCEL, now=task.created_at, reason="why")
    assert OutboxMessage.objects.count() == count


# --- the worker reads and writes the same shapes ---------------------------------------------------------


@pytest.fixture
def service():
    return InMemoryService(FakeClock())


def run_once(tmp_path, service) -> None:
    worker = make_worker(tmp_path, service.clock, roots=[str(tmp_path)], connect=lambda: service,
                         profiles={"instant": {"AGENT_SLEEP_S": "0"}},
                         options=WorkerOptions(server="memory://", once=True, poll_wait_s=0))
    result: list = []
    thread = threading.Thread(target=lambda: result.append(worker.run()), daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert result == [0]


def test_h_receipts_the_real_worker_writes_match_their_shapes(tmp_path, service):
    """A run and a query through the real worker: every receipt it sent is its shape
    (``InMemoryService`` answers 400 to one that is not, and none was)."""
    start = service.add_start(folder=str(tmp_path), grant_root=str(tmp_path), agent="instant")
    run_once(tmp_path, service)
    service.query(start.operation_id)
    service.query(str(uuid.uuid4()))  # no record: ``record: null``
    run_once(tmp_path, service)
    calls = service.calls_to("receipt")
    assert calls and {c.status for c in calls} == {200}
    bodies = [c.args["body"] for c in calls]
    assert {b["kind"] for b in bodies} == {"starting", "running", "final", "report"}
    for body in bodies:
        assert check_receipt(body) is body


def test_h_worker_reader_leaves_out_unknown_fields_and_ignores_a_message_missing_one(tmp_path, service, caplog):
    """A ``start`` with a field its shape does not name (a newer service) runs without that
    field, and the worker logs it; one without a required field is acknowledged and never
    run; the well-formed one runs."""
    extra = service.add_start(folder=str(tmp_path), grant_root=str(tmp_path), agent="instant")
    extra.payload["surprise"] = True
    missing = service.add_start(folder=str(tmp_path), grant_root=str(tmp_path), agent="instant")
    del missing.payload["grant_root"]
    good = service.add_start(folder=str(tmp_path), grant_root=str(tmp_path), agent="instant")
    with caplog.at_level("WARNING", logger="runstead.worker"):
        run_once(tmp_path, service)
    assert extra.acks == missing.acks == good.acks == 1
    assert service.receipts_for(missing.operation_id) == []
    assert service.receipt(extra.operation_id, "final")["facts"]["stop_reason"] == "exit"
    assert service.receipt(good.operation_id, "final")["facts"]["stop_reason"] == "exit"
    assert count_lines(tmp_path / "starts") == 2
    assert "left out: surprise" in caplog.text


def test_h_both_sides_fail_on_a_field_the_shape_does_not_name(service):
    """The one check, as each side calls it: ``InMemoryService`` (the service in the
    worker's tests) refuses to give such a message; the worker refuses to build such a
    receipt, and ``InMemoryService`` refuses one that was not built by it (400, R3)."""
    with pytest.raises(ProtocolError, match="CancelPayload: unknown field.s. why"):
        service.add_message("cancel", str(uuid.uuid4()), {"why": "no reason"})
    with pytest.raises(ProtocolError, match="QueryPayload: missing field.s. query_id"):
        service.add_message("query", str(uuid.uuid4()), {})
    with pytest.raises(ProtocolError, match="unknown message kind"):
        check_message("restart", {"operation_id": "x"})
    identity = type("Identity", (), {"generation": 1})()
    good = final_facts(process_started=True, exit_code=0, stop_reason="exit")
    receipt_item(identity, operation_id="op", kind="final", facts=good, slept=0.0)
    with pytest.raises(ProtocolError, match="FinalFacts: unknown field.s. mood"):
        receipt_item(identity, operation_id="op", kind="final", facts={**good, "mood": "fine"}, slept=0.0)
    with pytest.raises(ProtocolError, match="ReportFacts: missing field.s. record"):
        receipt_item(identity, operation_id="op", kind="report", facts={"query_id": "q"}, slept=0.0)
    with pytest.raises(ProtocolError, match="FinalFacts: missing field.s. stop_reason"):
        check_receipt({"event_id": "e", "generation": 1, "operation_id": "op", "kind": "report", "facts": {
            "query_id": "q", "record": {"local_state": "ended", "pid": 1, "lease_id": None,
                                        "final": {k: v for k, v in good.items() if k != "stop_reason"}}}})
    body = receipt_item(identity, operation_id="op", kind="final", facts=good, slept=0.0)["body"]
    assert service.send("POST", RECEIPTS_PATH, {**body, "extra": 1}).status == 400
    assert service.send("POST", RECEIPTS_PATH, {**body, "facts": {**good, "mood": "fine"}}).status == 400
    assert service.send("POST", RECEIPTS_PATH, body).status == 200


def test_h_receipt_serializer_names_the_fields_of_the_receipt_shape():
    """The service's input serializer and ``ReceiptBody``: the same fields, the same
    required ones, the same kinds; one facts shape per kind."""
    fields = ReceiptSerializer().fields
    assert set(fields) == set(ReceiptBody.__annotations__)
    assert {name for name, field in fields.items() if field.required} == set(ReceiptBody.__required_keys__)
    assert tuple(fields["kind"].choices) == RECEIPT_KINDS == tuple(RECEIPT_FACTS)


def test_sync_body_and_its_serializer_name_the_same_fields():
    """``POST /api/worker/sync/``: ``SyncBody`` and ``SyncRenewal`` of the protocol and the
    service's input serializers, field for field (required ones too)."""
    from machine.protocol.shapes import SyncBody, SyncRenewal
    from tasks_app.api.serializers import SyncRenewalSerializer, SyncSerializer

    for shape, serializer in ((SyncBody, SyncSerializer), (SyncRenewal, SyncRenewalSerializer)):
        fields = serializer().fields
        assert set(fields) == set(shape.__annotations__)
        assert {name for name, field in fields.items() if field.required} == set(shape.__required_keys__)
