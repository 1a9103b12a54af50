"""B11 and K3: every list pages with one stable cursor, newest first with ties broken by
id, so rows that share a ``created_at`` are each listed exactly once."""
import uuid

from tests.conftest import owner_api
from tests.factories import submit


def page_through(client, path, limit):
    """Follow ``next`` links from ``path``; returns the ids in the order listed."""
    ids, url, pages = [], f"{path}?limit={limit}", 0
    while url:
        response = client.get(url)
        assert response.status_code == 200, response.content
        body = response.json()
        assert set(body) == {"results", "next"}
        assert len(body["results"]) <= limit
        ids += [row["id"] for row in body["results"]]
        url, pages = body["next"], pages + 1
    return ids, pages


def documented_order(rows):
    """Newest first, ties broken by id (descending)."""
    return [str(r.id) for r in sorted(rows, key=lambda r: (r.created_at, r.id), reverse=True)]


def test_b11_cursor_ties_broken_by_id(owner, machine, grant, pinned):
    from tasks_app.models import Task

    for _ in range(3):
        assert submit(owner, machine, grant.path, exclusive=False).status_code == 201
    pinned.shift(1)
    for _ in range(7):  # seven tasks with one created_at
        assert submit(owner, machine, grant.path, exclusive=False).status_code == 201
    tasks = list(Task.objects.filter(owner=owner))
    assert len({t.created_at for t in tasks}) == 2

    ids, pages = page_through(owner_api(owner), "/api/tasks/", limit=2)
    assert ids == documented_order(tasks)
    assert len(ids) == len(set(ids)) == 10 and pages == 5


def test_b11_sessions_machines_and_grants_page_the_same_way(owner, make_machine, grant_root, pinned):
    from sessions_app.models import Session
    from tasks_app.models import Grant, Machine

    client = owner_api(owner)
    for _ in range(5):
        assert client.post("/api/sessions/", {"id": str(uuid.uuid4()), "title": "s"}, format="json").status_code == 201
    machines = [make_machine(owner, name=f"m{i}") for i in range(4)]
    for i, m in enumerate(machines):
        (grant_root / str(i)).mkdir()
        Grant.objects.create(owner=owner, machine=m, path=str(grant_root / str(i)))

    for path, model in (("/api/sessions/", Session), ("/api/machines/", Machine), ("/api/grants/", Grant)):
        rows = list(model.objects.filter(owner=owner))
        assert len({r.created_at for r in rows}) == 1, path
        ids, _ = page_through(client, path, limit=2)
        assert ids == documented_order(rows), path


def test_b11_default_limit_is_50_and_limit_bounds(owner, machine, grant, pinned):
    from tasks_app.models import Budget

    Budget.objects.filter(owner=owner).update(limit_s=10**7)
    for _ in range(51):
        assert submit(owner, machine, grant.path, exclusive=False, max_runtime_s=1).status_code == 201
    client = owner_api(owner)
    first = client.get("/api/tasks/").json()
    assert len(first["results"]) == 50 and first["next"]
    assert len(client.get(first["next"]).json()["results"]) == 1
    assert len(client.get("/api/tasks/?limit=100").json()["results"]) == 51
    assert len(client.get("/api/tasks/?limit=1").json()["results"]) == 1
    for bad in ("0", "101", "-1", "1.5", "", "ten"):
        response = client.get(f"/api/tasks/?limit={bad}")
        assert (response.status_code, response.json()["error"]) == (400, "invalid"), bad


def test_b11_filters_by_state_machine_and_session(owner, machine, make_machine, grant, grant_root, pinned):
    from tasks_app.models import Grant

    other = make_machine(owner, name="desktop")
    (grant_root / "o").mkdir()
    Grant.objects.create(owner=owner, machine=other, path=str(grant_root / "o"))
    session = str(uuid.uuid4())
    client = owner_api(owner)
    client.post("/api/sessions/", {"id": session, "title": "s"}, format="json")
    a = submit(owner, machine, grant.path, exclusive=False).json()["id"]
    b = submit(owner, machine, grant.path, exclusive=False, session=session).json()["id"]
    c = submit(owner, other, str(grant_root / "o")).json()["id"]
    assert client.post(f"/api/tasks/{a}/cancel/").status_code == 200

    def listed(query):
        return {t["id"] for t in client.get(f"/api/tasks/?{query}").json()["results"]}

    assert listed(f"machine={machine.id}") == {a, b}
    assert listed(f"machine={other.id}") == {c}
    assert listed(f"session={session}") == {b}
    assert listed("state=cancelled") == {a}
    assert listed(f"state=accepted&machine={machine.id}") == {b}
