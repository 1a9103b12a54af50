"""``InMemoryService`` answers as the real API does (STYLE 11; issue 18): one worker
scenario, run by the same in-process worker once against ``InMemoryService`` and once
against a real daphne, gives the same receipts and the same answers.

The scenario: a task that succeeds, one the worker refuses (W4: a folder that leaves the
allowed root through a symlink), and one cancelled while it runs (J7) after a renewal
and a progress post. Compared: per operation, the worker's receipts in order (kinds,
the facts that do not depend on timing, the answers it got, from its own outbox), and
for every route the worker called, the answers' shapes (ids, times, paths, numbers and
texts replaced by their kind). The tests of the worker loop that use the in-memory
service (tests/test_worker_loop.py) rely on this.
"""
import difflib
import json
import re
import signal
import threading
from pathlib import Path

import pytest

from machine.worker.client import HttpService
from machine.worker.clock import SYSTEM_CLOCK
from machine.worker.loop import WorkerOptions
from machine.worker.testing import InMemoryService
from tests.live import live_daphne  # noqa: F401  (fixture)
from tests.wait import wait_for
from tests.worker_harness import SHORT_TIMINGS, LiveSetup, make_worker

pytestmark = pytest.mark.slow

# InMemoryService with the real daphne's timings (seconds): SHORT_TIMINGS with a lease long
# enough that no run outlives it on a loaded machine (ended_within_lease is compared).
TERMS = {"duration_s": 15.0, "renew_every_s": 0.5, "margin_s": 0.5, "kill_grace_s": 0.5}
LIVE_TIMINGS = {**SHORT_TIMINGS, "RUNSTEAD_LEASE_DURATION_S": "15"}
VISIBILITY_S = 1.0
# Facts of a final receipt that do not depend on timing (J1); the others are compared by kind.
FINAL_FACTS = ("process_started", "exit_code", "signal", "ended_within_lease", "stop_reason", "survivors",
               "refused_reason")
UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
ISO_TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)$")
TEXTS = {"detail", "output_tail", "last_message", "prompt"}


def shape(value, key=None):
    """``value`` with what differs between two runs replaced by its kind: ids, times,
    absolute paths, numbers, free texts. Booleans, None, codes and names stay."""
    if isinstance(value, dict):
        return {k: shape(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(v) for v in value]
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int | float):
        return "<number>"
    if isinstance(value, str):
        if key in TEXTS:
            return "<text>"
        if UUID.match(value.split(":")[0]):
            return "<id>" + value[36:]  # an event id keeps its ":kind"
        if ISO_TIME.match(value):
            return "<time>"
        if value.startswith("/"):
            return "<path>"
    return value


class Recorded:
    """A ``client.Service`` that notes every call as ``(route, subject, status, body)``
    in ``calls`` (shared by the worker's threads)."""

    ROUTES = (("/api/worker/receipts/", "receipt"), ("/api/worker/sync/", "sync"), ("/api/worker/profiles/", "profiles"),
              ("/sweep/", "sweep"), ("/marker/", "marker"))

    def __init__(self, inner, calls: list):
        self.inner, self.calls = inner, calls

    def _note(self, route, subject, answer):
        self.calls.append((route, subject, answer.status, answer.body))
        return answer

    def pull(self, wait_s):
        return self._note("pull", None, self.inner.pull(wait_s))

    def ack(self, message_id):
        return self._note("ack", message_id, self.inner.ack(message_id))

    def lease_grant(self, operation_id):
        return self._note("grant", operation_id, self.inner.lease_grant(operation_id))

    def lease_renew(self, lease_id, *, output_tail, timeout_s):
        return self._note("renew", lease_id, self.inner.lease_renew(lease_id, output_tail=output_tail,
                                                                     timeout_s=timeout_s))

    def progress(self, body):
        return self._note("progress", body["operation_id"], self.inner.progress(body))

    def send(self, method, path, body, timeout_s=None):
        route = next(name for part, name in self.ROUTES if part in path)
        return self._note(route, body.get("operation_id"), self.inner.send(method, path, body, timeout_s=timeout_s))

    def close(self):
        self.inner.close()


class Memory:
    """The scenario's service side in memory."""

    def __init__(self, tmp_path: Path):
        self.service = InMemoryService(SYSTEM_CLOCK, visibility_s=VISIBILITY_S, **TERMS)
        self.service.sync_route = True  # as the real API: receipts queued together go in one sync (issue 44)
        self.root = tmp_path / "root"
        (self.root / "repo").mkdir(parents=True)
        self.url = "memory://"

    def connect(self):
        return self.service

    def submit(self, agent: str, folder: Path) -> str:
        return self.service.add_start(folder=str(folder), grant_root=str(self.root), agent=agent).operation_id

    def cancel(self, operation_id: str) -> None:
        self.service.cancel(operation_id)

    def close(self):
        pass


class Live:
    """The same against a real daphne (its API, as an owner would use it)."""

    def __init__(self, url, owner, tmp_path: Path):
        self.setup = LiveSetup(url, owner, tmp_path)
        self.root, self.url = self.setup.root, url
        self.token = (self.setup.state_dir / "token").read_text().strip()
        self.tasks: dict[str, str] = {}  # operation id -> task id

    def connect(self):
        return HttpService(self.url, self.token)

    def submit(self, agent: str, folder: Path) -> str:
        from tasks_app.models import Operation

        task_id = self.setup.submit(agent, folder=folder)
        operation_id = str(Operation.objects.get(task_id=task_id).id)
        self.tasks[operation_id] = task_id
        return operation_id

    def cancel(self, operation_id: str) -> None:
        assert self.setup.api.post(f"/api/tasks/{self.tasks[operation_id]}/cancel/").status_code == 200

    def close(self):
        self.setup.close()


def run_scenario(side, tmp_path: Path) -> dict:
    """The scenario against ``side`` (``Memory`` or ``Live``) by an in-process worker on
    the real clock; returns what the worker saw: ``{"receipts": {name: [...]}, "routes":
    {route: [answer shapes]}}``."""
    calls: list = []
    outside = tmp_path / "outside"
    outside.mkdir()
    (side.root / "escape").symlink_to(outside)
    worker = make_worker(tmp_path, SYSTEM_CLOCK, roots=[str(side.root)], server=side.url,
                         connect=lambda: Recorded(side.connect(), calls),
                         options=WorkerOptions(server=side.url, poll_wait_s=1.0, backoff_base_s=0.2))
    store = worker.ctx.store
    result: list = []
    thread = threading.Thread(target=lambda: result.append(worker.run()), name="main", daemon=True)
    thread.start()

    def final_sent(operation_id):
        return any(r["operation_id"] == operation_id and r["kind"] == "final" and r["status"] == "done"
                   for r in store.outbox.rows())

    ops = {}
    try:
        ops["succeeds"] = side.submit("quick", side.root / "repo")
        wait_for(lambda: final_sent(ops["succeeds"]), timeout_s=20, what="the final receipt of the quick task")
        ops["refused"] = side.submit("quick", side.root / "escape")
        wait_for(lambda: final_sent(ops["refused"]), timeout_s=20, what="the final receipt of the refused task")
        ops["cancelled"] = op = side.submit("long", side.root / "repo")
        wait_for(lambda: (r := store.get(op)) and r["local_state"] == "running", timeout_s=20, what="the agent running")
        lease_id = store.get(op)["lease_id"]
        wait_for(lambda: {"renew", "progress"} <= {route for route, subject, status, _ in list(calls)
                                                   if subject in (op, lease_id) and status == 200},
                 timeout_s=20, what="a renewal and a progress post")
        side.cancel(op)
        wait_for(lambda: final_sent(op), timeout_s=20, what="the final receipt of the cancelled task")
    finally:
        worker.on_signal()  # W6: drain, report, exit
        thread.join(30)
        side.close()
    assert result == [0], "the worker did not exit cleanly"

    receipts = {}
    for name, operation_id in ops.items():
        rows = [r for r in store.outbox.rows() if r["operation_id"] == operation_id]
        receipts[name] = []
        for row in rows:
            facts = json.loads(row["body"])["facts"]
            kept = {k: facts.get(k) for k in FINAL_FACTS if k in facts} if row["kind"] == "final" else {}
            receipts[name].append({"kind": row["kind"], "status": row["status"], "attempts": row["attempts"],
                                   "answer": shape(json.loads(row["answer"])), "facts": kept,
                                   "fact_shapes": shape(facts)})
    routes: dict[str, list] = {}
    for route, _, status, body in calls:
        if route == "renew" and status != 200:
            continue  # a renewal refused after the cancel, or not: a matter of timing
        if route == "sync" and status == 200:
            # Receipts that were queued together went in one sync (a matter of timing): each
            # item is that receipt's answer, compared with the receipt route's.
            route, entries = "receipt", [json.dumps([i["status"], shape(i["answer"])], sort_keys=True)
                                         for i in body.get("receipts") or []]
        elif route == "pull" and status == 200:
            # Each message delivered; how many pulls came back empty is a matter of timing.
            entries = [json.dumps([status, shape(m)], sort_keys=True) for m in body["messages"]]
        else:
            entries = [json.dumps([status, shape(body)], sort_keys=True)]
        for entry in entries:
            if entry not in routes.setdefault(route, []):
                routes[route].append(entry)
    return {"receipts": receipts, "routes": {k: sorted(v) for k, v in routes.items()}}


def differences(memory, real) -> str:
    """A unified diff of the two, for the failure message."""
    a, b = (json.dumps(x, indent=1, sort_keys=True).splitlines() for x in (memory, real))
    return "\n" + "\n".join(difflib.unified_diff(a, b, "in memory", "real daphne", lineterm=""))


def test_in_memory_service_answers_the_worker_as_the_real_api_does(live_daphne, make_owner, tmp_path):  # noqa: F811
    memory = run_scenario(Memory(tmp_path / "memory"), tmp_path / "memory")
    real = run_scenario(Live(live_daphne(**LIVE_TIMINGS), make_owner(), tmp_path / "live"), tmp_path / "live")

    # The scenario happened as named, on both sides.
    for seen in (memory, real):
        kinds = {name: [r["kind"] for r in rows] for name, rows in seen["receipts"].items()}
        assert kinds == {"succeeds": ["starting", "running", "final"], "refused": ["final"],
                         "cancelled": ["starting", "running", "final"]}
        finals = {name: rows[-1]["facts"] for name, rows in seen["receipts"].items()}
        assert finals["succeeds"] == {"process_started": True, "exit_code": 0, "signal": None,
                                      "ended_within_lease": True, "stop_reason": "exit", "survivors": []}
        assert finals["refused"]["process_started"] is False and finals["refused"]["stop_reason"] == "refused"
        assert finals["cancelled"]["stop_reason"] == "cancel" and finals["cancelled"]["signal"] == signal.SIGTERM
        assert {"pull", "ack", "grant", "renew", "progress", "receipt", "sweep", "profiles"} <= set(seen["routes"])
    assert memory["receipts"] == real["receipts"], differences(memory["receipts"], real["receipts"])
    assert memory["routes"] == real["routes"], differences(memory["routes"], real["routes"])
