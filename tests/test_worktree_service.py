"""The service's side of worktree tasks (SPEC G7, A8, K3, H): ``isolation`` on acceptance
(strict, the profile's as reported, no folder lock), the start payload, and the G7
evidence of final facts (branch, base, files, diff), validated and kept out of lists and
events."""
import json
import uuid

import pytest
from django.conf import settings

from tasks_app.agent_facts import DIFF_MAX_BYTES, FILES_MAX
from tasks_app.models import IdempotencyRecord, OutboxMessage, Task
from tests.conftest import machine_api, owner_api
from tests.factories import final_facts, grant_lease, receipt, submit, table_digest

pytestmark = pytest.mark.django_db

BASE = "c0ffee" + "0" * 34
END = "beef" + "1" * 36


def worktree_git(**overrides) -> dict:
    """``evidence.git`` of a worktree task that changed one file."""
    git = {"start_head": BASE, "end_head": END, "commits": 1, "subjects": ["agent: fix"], "files_changed": 1,
           "insertions": 1, "deletions": 1, "dirty": [], "dirty_count": 0, "start_dirty": 0,
           "branch": "runstead/abcd1234", "base": BASE, "base_branch": "main",
           "files": [{"status": "M", "path": "a.py", "insertions": 1, "deletions": 1}],
           "diff": "diff --git a/a.py b/a.py\n--- a/a.py\n+++ b/a.py\n@@ -1 +1 @@\n-one\n+ONE\n", "truncated": False}
    git.update(overrides)
    return git


def start_payload(task_id) -> dict:
    return OutboxMessage.objects.get(operation__task_id=task_id, kind="start").payload


def test_g7_isolation_is_strict_input(owner, machine, grant, grant_root, pinned):
    before = table_digest()
    for bad in ("yes", "Worktree", "", 5, True, None, ["worktree"]):
        response = submit(owner, machine, grant_root, isolation=bad)
        assert response.status_code == 400, (bad, response.content)
        assert response.json()["error"] == "invalid" and "isolation" in response.json()["fields"]
    assert table_digest() == before


def test_g7_worktree_tasks_take_no_folder_lock_and_the_payload_carries_isolation(owner, machine, grant, grant_root,
                                                                                   pinned):
    ids = [submit(owner, machine, grant_root, isolation="worktree").json()["id"] for _ in range(3)]
    assert [Task.objects.get(pk=i).holds_lock for i in ids] == [False] * 3
    assert all(start_payload(i)["isolation"] == "worktree" for i in ids)
    in_place = submit(owner, machine, grant_root / "sub")  # an exclusive task in place: the worktrees do not lock it out
    assert in_place.status_code == 201 and in_place.json()["isolation"] == "none" and in_place.json()["holds_lock"]
    assert start_payload(in_place.json()["id"])["isolation"] == "none"
    locked = submit(owner, machine, grant_root, isolation="none")
    assert (locked.status_code, locked.json()["error"]) == (409, "folder_locked")
    assert submit(owner, machine, grant_root, isolation="worktree").status_code == 201  # but worktrees still run


def test_g7_the_profiles_reported_isolation_applies_unless_the_task_says(owner, machine, grant, grant_root, pinned):
    profiles = {"profiles": [{"name": "wt", "preset": "claude", "isolation": "worktree"}, {"name": "demo", "preset": None}]}
    assert machine_api(machine).put("/api/worker/profiles/", profiles, format="json").status_code == 200
    by_profile = submit(owner, machine, grant_root, agent="wt").json()
    assert (by_profile["isolation"], by_profile["holds_lock"]) == ("worktree", False)
    overridden = submit(owner, machine, grant_root, agent="wt", isolation="none").json()
    assert (overridden["isolation"], overridden["holds_lock"]) == ("none", True)
    plain = submit(owner, machine, grant_root, agent="demo", exclusive=False).json()
    assert (plain["isolation"], start_payload(plain["id"])["isolation"]) == ("none", "none")
    bad = machine_api(machine).put("/api/worker/profiles/", {"profiles": [{"name": "x", "preset": None,
                                                                           "isolation": "branch"}]}, format="json")
    assert bad.status_code == 400


def finish(owner, machine, folder, git) -> tuple[str, object]:
    task_id = submit(owner, machine, folder, isolation="worktree").json()["id"]
    assert grant_lease(machine, task_id).status_code == 201
    receipt(machine, task_id, "running", {"pid": 10})
    return task_id, receipt(machine, task_id, "final", final_facts(evidence={"git": git}))


def test_g7_diff_evidence_is_kept_whole_in_the_task_and_left_out_of_lists_and_events(owner, machine, grant, grant_root,
                                                                                       pinned):
    # A diff at the limit, written the way JSON escapes most (quotes, backslashes, control
    # characters): the receipt body is well over DATA_UPLOAD_MAX_MEMORY_SIZE, and accepted.
    line = '+"\\\x1b<script>alert(1)</script>\n'
    diff = "diff --git a/a.py b/a.py\n" + line * ((DIFF_MAX_BYTES - 30) // len(line.encode()))
    assert len(diff.encode()) <= DIFF_MAX_BYTES
    files = [{"status": "M", "path": f"f{i}.py", "insertions": i, "deletions": 0} for i in range(FILES_MAX)]
    git = worktree_git(diff=diff, files=files, truncated=True)
    task_id, answer = finish(owner, machine, grant_root, git)
    assert answer.json() == {"outcome": "applied"}, answer.content
    assert len(json.dumps({"facts": {"evidence": {"git": git}}})) > settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    api = owner_api(owner)
    detail = api.get(f"/api/tasks/{task_id}/").json()
    assert detail["state"] == "succeeded" and detail["evidence"]["git"] == git
    listed = api.get("/api/tasks/").json()["results"][0]
    assert listed["evidence"]["git"] == {k: v for k, v in git.items() if k not in ("files", "diff")}
    board = api.get("/api/board/").json()["tasks"][0]
    assert "diff" not in board["evidence"]["git"] and board["evidence"]["git"]["branch"] == "runstead/abcd1234"


@pytest.mark.parametrize("bad", [
    {"base": "main"},
    {"base": None},
    {"branch": ""},
    {"branch": 7},
    {"base_branch": "a\nb"},
    {"files": [{"status": "Q", "path": "a", "insertions": 1, "deletions": 0}]},
    {"files": [{"status": "M", "path": "", "insertions": 1, "deletions": 0}]},
    {"files": [{"status": "M", "path": "a", "insertions": "1", "deletions": 0}]},
    {"files": [{"status": "M", "path": "a", "insertions": 1, "deletions": 0, "mode": "x"}]},
    {"files": [{"status": "M", "path": "a", "insertions": 1, "deletions": 0}] * (FILES_MAX + 1)},
    {"diff": "x" * (DIFF_MAX_BYTES + 1)},
    {"diff": ["x"]},
    {"truncated": "yes"},
])
def test_g7_malformed_diff_evidence_is_refused_and_changes_nothing(owner, machine, grant, grant_root, pinned, bad):
    task_id = submit(owner, machine, grant_root, isolation="worktree").json()["id"]
    assert grant_lease(machine, task_id).status_code == 201
    receipt(machine, task_id, "running", {"pid": 10})
    before = table_digest()
    answer = receipt(machine, task_id, "final", final_facts(evidence={"git": worktree_git(**bad)}))
    assert answer.status_code == 400 and answer.json()["error"] == "invalid", answer.content
    assert table_digest() == before
    assert Task.objects.get(pk=task_id).state == "running"


def test_g7_not_a_git_repository_is_a_refused_reason(owner, machine, grant, grant_root, pinned):
    task_id = submit(owner, machine, grant_root, isolation="worktree").json()["id"]
    facts = final_facts(process_started=False, stop_reason="refused", exit_code=None, runtime_s=0.0,
                        refused_reason="not_a_git_repository")
    assert receipt(machine, task_id, "final", facts).json() == {"outcome": "applied"}
    assert Task.objects.get(pk=task_id).state == "not_started"


# --- merge or discard, once -----------------------------------------------------------------


def integrate(owner, task_id, body, key=None):
    return owner_api(owner).post(f"/api/tasks/{task_id}/integrate/", body, format="json",
                                 HTTP_IDEMPOTENCY_KEY=key or str(uuid.uuid4()))


def finished_worktree_task(owner, machine, folder, **git) -> str:
    task_id, answer = finish(owner, machine, folder, worktree_git(**git))
    assert answer.json() == {"outcome": "applied"}, answer.content
    return task_id


def test_g7_merge_is_decided_once_with_the_outbox_message_in_the_same_transaction(owner, machine, grant, grant_root,
                                                                                    pinned):
    task_id = finished_worktree_task(owner, machine, grant_root)
    first = integrate(owner, task_id, {"action": "merge"}, key="merge-1")
    assert first.status_code == 202, first.content
    body = first.json()
    assert body["integration"] == {
        "id": body["integration"]["id"], "action": "merge", "outcome": None, "commit": None, "paths": [], "detail": "",
        "decided_by": "alice", "decided_at": "2026-03-01T00:00:00+00:00", "reported_at": None}
    message = OutboxMessage.objects.get(operation__task_id=task_id, kind="integrate")
    assert message.payload == {"operation_id": start_payload(task_id)["operation_id"],
                               "integration_id": body["integration"]["id"], "action": "merge",
                               "branch": "runstead/abcd1234", "base": BASE, "base_branch": "main", "head": END}
    events = owner_api(owner).get(f"/api/tasks/{task_id}/").json()["events"]
    assert events[-1]["reason"] == "owner decision: merge branch runstead/abcd1234" and events[-1]["actor"] == "owner:alice"

    before = table_digest()  # the refusals and the replay below change nothing
    replay = integrate(owner, task_id, {"action": "merge"}, key="merge-1")
    assert (replay.status_code, replay.content, replay["Idempotent-Replayed"]) == (202, first.content, "true")
    again = integrate(owner, task_id, {"action": "discard"})
    assert (again.status_code, again.json()["error"]) == (409, "already_decided")
    reused = integrate(owner, task_id, {"action": "discard"}, key="merge-1")
    assert (reused.status_code, reused.json()["error"]) == (422, "idempotency_key_reused")
    assert table_digest() == before
    other = finished_worktree_task(owner, machine, grant_root)
    assert integrate(owner, other, {"action": "merge"}, key="merge-1").status_code == 422  # one key, one decision
    assert OutboxMessage.objects.filter(kind="integrate").count() == 1


def test_g7_the_integrated_receipt_is_applied_once_and_shows_in_task_json(owner, machine, grant, grant_root, pinned):
    task_id = finished_worktree_task(owner, machine, grant_root)
    integration_id = integrate(owner, task_id, {"action": "merge"}).json()["integration"]["id"]
    facts = {"integration_id": integration_id, "outcome": "merged", "commit": END, "detail": "fast-forward"}
    first = receipt(machine, task_id, "integrated", facts, event_id=f"integrated:{integration_id}")
    assert first.json() == {"outcome": "applied"}
    assert receipt(machine, task_id, "integrated", facts, event_id=f"integrated:{integration_id}").content == first.content
    late = receipt(machine, task_id, "integrated", {**facts, "outcome": "conflict"})
    assert late.json() == {"outcome": "not_applied", "reason": "already_reported"}
    task = owner_api(owner).get(f"/api/tasks/{task_id}/").json()
    assert task["state"] == "succeeded"  # a final state never changes; only the integration does
    assert (task["integration"]["outcome"], task["integration"]["commit"], task["integration"]["detail"]) == (
        "merged", END, "fast-forward")
    assert task["integration"]["reported_at"] is not None
    listed = owner_api(owner).get("/api/tasks/").json()["results"]
    assert [t["integration"]["outcome"] for t in listed if t["id"] == task_id] == ["merged"]
    unknown = receipt(machine, task_id, "integrated", {**facts, "integration_id": str(uuid.uuid4())})
    assert unknown.json() == {"outcome": "not_applied", "reason": "unknown_integration"}


@pytest.mark.parametrize("facts", [
    {"outcome": "merged"},
    {"integration_id": "x", "outcome": "merged"},
    {"integration_id": 5, "outcome": "merged"},
    {"integration_id": "{id}", "outcome": "done"},
    {"integration_id": "{id}", "outcome": "merged", "commit": "HEAD"},
    {"integration_id": "{id}", "outcome": "conflict", "paths": "a.py"},
    {"integration_id": "{id}", "outcome": "merged", "extra": 1},
])
def test_g7_malformed_integrated_receipts_are_refused(owner, machine, grant, grant_root, pinned, facts):
    task_id = finished_worktree_task(owner, machine, grant_root)
    integration_id = integrate(owner, task_id, {"action": "merge"}).json()["integration"]["id"]
    facts = {k: (integration_id if v == "{id}" else v) for k, v in facts.items()}
    before = table_digest()
    answer = receipt(machine, task_id, "integrated", facts)
    assert answer.status_code == 400 and answer.json()["error"] == "invalid", answer.content
    assert table_digest() == before


def test_g7_integrate_refusals_are_clear_and_change_nothing(owner, other_owner, machine, grant, grant_root, pinned):
    unfinished = submit(owner, machine, grant_root, isolation="worktree").json()["id"]
    in_place = submit(owner, machine, grant_root, exclusive=False).json()["id"]
    receipt(machine, in_place, "final", final_facts(process_started=False, stop_reason="refused", runtime_s=0.0))
    never_started = submit(owner, machine, grant_root, isolation="worktree").json()["id"]
    receipt(machine, never_started, "final", final_facts(process_started=False, stop_reason="refused", runtime_s=0.0,
                                                         refused_reason="not_a_git_repository"))
    detached = finished_worktree_task(owner, machine, grant_root, base_branch=None)
    mine = finished_worktree_task(owner, machine, grant_root)
    before = table_digest()
    cases = [
        (owner, unfinished, {"action": "merge"}, 409, "not_final"),
        (owner, in_place, {"action": "merge"}, 409, "not_worktree"),
        (owner, never_started, {"action": "discard"}, 409, "no_branch"),
        (owner, detached, {"action": "merge"}, 409, "no_base_branch"),
        (other_owner, mine, {"action": "merge"}, 404, "not_found"),
        (owner, str(uuid.uuid4()), {"action": "merge"}, 404, "not_found"),
        (owner, mine, {"action": "rebase"}, 400, "invalid"),
        (owner, mine, {"action": "merge", "force": True}, 400, "invalid"),
        (owner, mine, {}, 400, "invalid"),
        (owner, mine, ["merge"], 400, "invalid"),
    ]
    for who, task_id, body, status, code in cases:
        answer = integrate(who, task_id, body)
        assert (answer.status_code, answer.json()["error"]) == (status, code), (task_id, body, answer.content)
    missing_key = owner_api(owner).post(f"/api/tasks/{mine}/integrate/", {"action": "merge"}, format="json")
    assert (missing_key.status_code, missing_key.json()["error"]) == (400, "idempotency_key_missing")
    assert table_digest() == before
    assert integrate(owner, detached, {"action": "discard"}).status_code == 202  # discard needs no base branch
    machine.paired = False
    machine.save()
    assert integrate(owner, mine, {"action": "merge"}).json()["error"] == "machine_unpaired"


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_g7_sixteen_racing_decisions_one_winner(owner, machine, grant, grant_root):
    from tests.barrier import race

    task_id = finished_worktree_task(owner, machine, grant_root)
    results = race(16, lambda i: integrate(owner, task_id, {"action": "merge" if i % 2 else "discard"}))
    statuses = sorted(r.status_code for r in results)
    assert statuses == [202] + [409] * 15, statuses
    assert all(r.json()["error"] == "already_decided" for r in results if r.status_code == 409)
    assert OutboxMessage.objects.filter(kind="integrate").count() == 1
    assert IdempotencyRecord.objects.filter(response_status=202).count() == 1
