"""The run as a person reads it, on the service (SPEC G4, B9, H, K3): transcript entries
from progress posts and from the final receipt are kept once per number, the last 500
per task, pushed in ``task.progress`` events and read back in pages from
``GET /api/tasks/{id}/entries/``; malformed entries are refused and change nothing."""
import json
from urllib.parse import parse_qs, urlsplit

import pytest

from tasks_app.models import Task, TranscriptEntry
from machine.protocol import ENTRIES_KEPT, ENTRIES_PER_POST, ENTRY_TEXT_MAX_BYTES
from tests.conftest import machine_api, owner_api
from tests.factories import final_facts, grant_lease, operation_id, receipt, submit
from tests.sessions_events import board_events  # noqa: F401  (fixture)

pytestmark = pytest.mark.django_db


def running(owner, machine, folder) -> str:
    task_id = submit(owner, machine, folder).json()["id"]
    assert grant_lease(machine, task_id).status_code == 201
    receipt(machine, task_id, "running", {"pid": 10, "pgid": 10, "process_start_time": 1.0})
    return task_id


def entry(n, kind="message", text=None, **extra):
    return {"n": n, "kind": kind, "text": f"entry {n}" if text is None else text, **extra}


def post(machine, task_id, seq, entries):
    body = {"operation_id": operation_id(task_id), "seq": seq, "output_tail": "", "last_message": None,
            "usage": None, "entries": entries}
    return machine_api(machine).post("/api/worker/progress/", body, format="json")


def kept(task_id) -> list[int]:
    return list(TranscriptEntry.objects.filter(task_id=task_id).order_by("n").values_list("n", flat=True))


def test_g4_entries_are_kept_once_per_number_and_pushed_with_the_progress(
        owner, machine, grant, grant_root, pinned, board_events, django_capture_on_commit_callbacks):  # noqa: F811
    task_id = running(owner, machine, grant_root)
    first = [entry(1, "prompt", "fix it"), entry(2, usage={"input_tokens": 12, "output_tokens": 3}),
             entry(3, "tool_call", "git status", tool="Bash")]
    board_events.clear()
    with django_capture_on_commit_callbacks(execute=True):
        assert post(machine, task_id, 1, first).json() == {"outcome": "applied"}
        # A post that timed out on the worker comes again with more: only the new ones count.
        again = [first[2], entry(4, "tool_result", "M a.py", tool="Bash", status="ok", call=3), entry(5, "error")]
        assert post(machine, task_id, 2, again).json() == {"outcome": "applied"}
    events = [e for e in board_events.of(owner) if e["type"] == "task.progress"]
    assert [[x["n"] for x in e["progress"]["entries"]] for e in events] == [[1, 2, 3], [4, 5]]
    assert events[1]["progress"]["entries"][0] == again[1]
    assert Task.objects.get(pk=task_id).progress["entries"] == again[1:]
    assert kept(task_id) == [1, 2, 3, 4, 5]
    page = owner_api(owner).get(f"/api/tasks/{task_id}/entries/").json()
    assert page == {"results": first + again[1:], "next": None}


def test_g4_c2_a_prompt_entry_keeps_the_seq_of_the_message_whose_turn_it_opens(owner, machine, grant, grant_root,
                                                                               pinned):
    task_id = running(owner, machine, grant_root)
    sent = [entry(1, "prompt", "first", seq=0), entry(2), entry(3, "prompt", "second", seq=1), entry(4)]
    assert post(machine, task_id, 1, sent).json() == {"outcome": "applied"}
    assert owner_api(owner).get(f"/api/tasks/{task_id}/entries/").json()["results"] == sent


def test_g4_a_post_not_applied_keeps_none_of_its_entries(owner, machine, grant, grant_root, pinned):
    task_id = running(owner, machine, grant_root)
    assert post(machine, task_id, 5, [entry(1)]).json()["outcome"] == "applied"
    assert post(machine, task_id, 4, [entry(2)]).json() == {"outcome": "not_applied", "reason": "stale_seq"}
    assert kept(task_id) == [1]


def test_g4_the_final_receipt_brings_the_entries_no_post_delivered(owner, machine, grant, grant_root, pinned):
    task_id = running(owner, machine, grant_root)
    assert post(machine, task_id, 1, [entry(1), entry(2)]).json()["outcome"] == "applied"
    facts = final_facts(entries=[entry(2), entry(3), entry(4, "error", "agent gave up")])
    assert receipt(machine, task_id, "final", facts).json() == {"outcome": "applied"}
    task = Task.objects.get(pk=task_id)
    assert task.state == "succeeded" and kept(task_id) == [1, 2, 3, 4]
    assert "entries" not in task.facts  # the transcript holds them, not the facts copy
    assert post(machine, task_id, 2, [entry(5)]).json() == {"outcome": "not_applied", "reason": "final"}
    assert kept(task_id) == [1, 2, 3, 4]


def test_g4_the_service_keeps_the_last_500_and_pages_them(owner, machine, grant, grant_root, pinned):
    task_id = running(owner, machine, grant_root)
    posts = 11  # 550 entries, 50 a post
    for seq in range(1, posts + 1):
        batch = [entry(n) for n in range((seq - 1) * ENTRIES_PER_POST + 1, seq * ENTRIES_PER_POST + 1)]
        assert post(machine, task_id, seq, batch).json()["outcome"] == "applied"
    total = posts * ENTRIES_PER_POST
    assert kept(task_id) == list(range(total - ENTRIES_KEPT + 1, total + 1))
    api = owner_api(owner)
    url, pages = f"/api/tasks/{task_id}/entries/", []
    while url:
        page = api.get(url).json()
        pages.append([e["n"] for e in page["results"]])
        url = page["next"]
    assert [(p[0], p[-1]) for p in pages] == [(351, 550), (151, 350), (51, 150)]  # newest 200 first, each in order
    page = api.get(f"/api/tasks/{task_id}/entries/?after=100&limit=30").json()
    assert [e["n"] for e in page["results"]] == list(range(101, 131))
    assert parse_qs(urlsplit(page["next"]).query) == {"after": ["130"], "limit": ["30"]}
    assert api.get(f"/api/tasks/{task_id}/entries/?after=540").json()["next"] is None


def test_k2_another_owners_transcript_is_404(owner, other_owner, machine, grant, grant_root, pinned):
    task_id = running(owner, machine, grant_root)
    assert post(machine, task_id, 1, [entry(1)]).json()["outcome"] == "applied"
    response = owner_api(other_owner).get(f"/api/tasks/{task_id}/entries/")
    assert response.status_code == 404 and response.json()["error"] == "not_found"


BAD_ENTRIES = [
    ("n as text", [{"n": "1", "kind": "message", "text": "x"}]),
    ("n zero", [entry(0)]),
    ("unknown kind", [entry(1, "thought")]),
    ("unknown key", [{**entry(1), "colour": "red"}]),
    ("no text", [{"n": 1, "kind": "message"}]),
    ("text over 2 KiB", [entry(1, text="é" * (ENTRY_TEXT_MAX_BYTES // 2 + 1))]),
    ("NUL in text", [entry(1, text="a\x00b")]),
    ("bad status", [entry(2, "tool_result", status="maybe")]),
    ("call not earlier", [entry(2, "tool_result", status="ok", call=2)]),
    ("tool too long", [entry(1, "tool_call", tool="t" * 101)]),
    ("usage keys", [entry(1, usage={"turns": 1})]),
    ("usage as text", [entry(1, usage={"input_tokens": "1", "output_tokens": 1})]),
    ("seq on a message", [entry(1, seq=1)]),
    ("seq negative", [entry(1, "prompt", seq=-1)]),
    ("seq as text", [entry(1, "prompt", seq="1")]),
    ("seq boolean", [entry(1, "prompt", seq=True)]),
    ("not rising", [entry(2), entry(1)]),
    ("too many", [entry(n) for n in range(1, ENTRIES_PER_POST + 2)]),
    ("not a list", {"n": 1}),
]


@pytest.mark.parametrize("bad", [b for _, b in BAD_ENTRIES], ids=[name for name, _ in BAD_ENTRIES])
def test_k3_malformed_entries_are_refused_in_progress_and_final(owner, machine, grant, grant_root, pinned, bad):
    task_id = running(owner, machine, grant_root)
    before = Task.objects.values().get(pk=task_id)
    response = post(machine, task_id, 1, bad)
    assert response.status_code == 400 and response.json()["error"] == "invalid" and "entries" in response.json()["fields"]
    response = receipt(machine, task_id, "final", final_facts(entries=bad))
    assert response.status_code == 400 and response.json()["error"] == "invalid"
    assert Task.objects.values().get(pk=task_id) == before and kept(task_id) == []


def test_k3_a_lone_surrogate_in_an_entry_is_refused(owner, machine, grant, grant_root, pinned):
    """JSON can spell a lone surrogate (``\\ud800``); PostgreSQL cannot store it: 400, not 500."""
    task_id = running(owner, machine, grant_root)
    body = json.dumps({"operation_id": operation_id(task_id), "seq": 1, "output_tail": "", "last_message": None,
                       "usage": None, "entries": [entry(1, text="x")]}).replace('"text": "x"', '"text": "\\ud800"')
    response = machine_api(machine).generic("POST", "/api/worker/progress/", body, content_type="application/json")
    assert response.status_code == 400 and "entries" in response.json()["fields"]
    assert kept(task_id) == []
