"""C8: ``"machine": "any"``: acceptance picks a machine (paired, heard from, with the
folder's repository granted and room under its ``max_concurrent``, least loaded first),
records the pick, replays it; none: 409 ``no_machine_available`` with why per machine.
Racing submits never overfill a machine (PostgreSQL, rows checked afterwards)."""
import subprocess
import uuid
from datetime import timedelta

import pytest
from django.utils import timezone

from core.broadcast import owner_group
from machine.worker.repositories import repository_identities, strip_credentials
from tasks_app.models import Budget, Grant, IdempotencyRecord, Machine, OutboxMessage, Task, TaskEvent
from tasks_app.services.machine_choice import LOAD_STATES, normalize_remote
from tests.barrier import race
from tests.conftest import owner_api
from tests.factories import table_digest
from tests.live import module_daphne  # noqa: F401  (fixture)
from tests.sessions_events import board_events  # noqa: F401  (fixture)
from tests.wait import wait_for

ROOT_A = "1" * 40
FINAL_OR_UNKNOWN = ("succeeded", "failed", "failed_lease_lost", "cancelled", "not_started", "abandoned", "unknown")


@pytest.fixture(autouse=True)
def _no_acceptance_brake(settings):
    settings.RUNSTEAD_ACCEPT_RATE = "100000/min"


def ready(machine, *, max_concurrent=2, repositories=(), heard=True, profiles=("demo",)):
    """A machine as its worker's start report leaves it (B10, C8), heard from just now."""
    Machine.objects.filter(pk=machine.pk).update(
        max_concurrent=max_concurrent, repositories=list(repositories),
        profiles=[{"name": p, "preset": None, "isolation": "none", "conversation": "none"} for p in profiles],
        last_heard_at=timezone.now() if heard else None)
    machine.refresh_from_db()
    return machine


def grant(machine, path):
    return Grant.objects.create(owner=machine.owner, machine=machine, path=str(path))


def submit_any(owner, folder, *, key=None, **extra):
    body = {"machine": "any", "folder": str(folder), "agent": "demo", "prompt": "do it", "exclusive": False, **extra}
    return owner_api(owner).post("/api/tasks/", body, format="json",
                                 HTTP_IDEMPOTENCY_KEY=key or f"any-{uuid.uuid4()}")


def nothing_written(owner):
    return (Task.objects.count(), IdempotencyRecord.objects.filter(owner=owner).count(),
            OutboxMessage.objects.count(), Budget.objects.get(owner=owner).reserved_s) == (0, 0, 0, 0)


@pytest.mark.django_db
def test_c8_least_loaded_machine_picked_recorded_and_replayed(owner, make_machine, tmp_path):
    laptop, desktop = ready(make_machine(owner, "laptop")), ready(make_machine(owner, "desktop"))
    for m in (laptop, desktop):
        grant(m, tmp_path)
    first = submit_any(owner, tmp_path / "repo", key="k1")
    assert first.status_code == 201, first.content
    assert (first.json()["machine"], first.json()["machine_choice"]) == (str(desktop.id), "any")  # a tie: by name
    second = submit_any(owner, tmp_path / "repo")
    assert second.json()["machine"] == str(laptop.id)  # the least loaded
    # A2: the replay answers the stored pick, byte-equal, though the loads changed since.
    replay = submit_any(owner, tmp_path / "repo", key="k1")
    assert (replay.content, replay.headers["Idempotent-Replayed"]) == (first.content, "true")
    assert Task.objects.count() == 2
    assert Task.objects.get(pk=first.json()["id"]).machine_id == desktop.id


@pytest.mark.django_db
def test_c8_same_repository_at_another_path_is_picked_there(owner, make_machine, tmp_path):
    """The folder's repository (by root commit, or origin URL once normalised) on another
    machine at another path: the task runs in the same sub-folder of that copy."""
    laptop = ready(make_machine(owner, "laptop"), max_concurrent=1,
                   repositories=[{"path": "/home/me/code/app", "remote": "git@github.com:me/app.git",
                                  "root_commit": ROOT_A}])
    desktop = ready(make_machine(owner, "desktop"), max_concurrent=1,
                    repositories=[{"path": "/Users/me/src/app-clone", "remote": "https://tok@github.com/me/app",
                                   "root_commit": None}])
    grant(laptop, "/home/me/code")
    grant(desktop, "/Users/me/src")
    Task.objects.all().delete()
    first = submit_any(owner, "/home/me/code/app/web")
    assert first.json()["machine"] == str(desktop.id)  # a tie: by name
    assert first.json()["folder"] == "/Users/me/src/app-clone/web"
    second = submit_any(owner, "/home/me/code/app/web")
    assert (second.json()["machine"], second.json()["folder"]) == (str(laptop.id), "/home/me/code/app/web")
    full = submit_any(owner, "/home/me/code/app/web")
    assert full.status_code == 409
    assert [(m["name"], m["reason"], m["load"]) for m in full.json()["machines"]] == [
        ("desktop", "full", 1), ("laptop", "full", 1)]


@pytest.mark.django_db
def test_c8_no_machine_available_says_why_per_machine_and_writes_nothing(owner, make_machine, tmp_path):
    gone = make_machine(owner, "a-unpaired")
    Machine.objects.filter(pk=gone.pk).update(paired=False)
    quiet = ready(make_machine(owner, "b-offline"))
    Machine.objects.filter(pk=quiet.pk).update(last_heard_at=timezone.now() - timedelta(hours=1))
    ready(make_machine(owner, "c-no-profile"), profiles=("other",))
    old = make_machine(owner, "d-old-worker")
    Machine.objects.filter(pk=old.pk).update(last_heard_at=timezone.now(), profiles=[{"name": "demo"}])
    ready(make_machine(owner, "e-no-grant"))
    other_repo = ready(make_machine(owner, "f-no-repo"), repositories=[{"path": "/x/other", "remote": None,
                                                                       "root_commit": "2" * 40}])
    grant(other_repo, "/x")
    resp = submit_any(owner, tmp_path / "repo")
    assert resp.status_code == 409
    body = resp.json()
    assert body["error"] == "no_machine_available"
    assert [(m["name"], m["reason"]) for m in body["machines"]] == [
        ("a-unpaired", "unpaired"), ("b-offline", "offline"), ("c-no-profile", "profile_not_reported"),
        ("d-old-worker", "limits_not_reported"), ("e-no-grant", "folder_not_granted"),
        ("f-no-repo", "folder_not_granted")]
    assert nothing_written(owner)


@pytest.mark.django_db
def test_c8_exclusive_folder_locked_on_one_machine_goes_to_the_other(owner, make_machine, tmp_path):
    laptop, desktop = ready(make_machine(owner, "laptop")), ready(make_machine(owner, "desktop"))
    for m in (laptop, desktop):
        grant(m, tmp_path)
    first = submit_any(owner, tmp_path, exclusive=True)
    second = submit_any(owner, tmp_path, exclusive=True)
    assert {first.json()["machine"], second.json()["machine"]} == {str(laptop.id), str(desktop.id)}
    third = submit_any(owner, tmp_path, exclusive=True)
    assert [m["reason"] for m in third.json()["machines"]] == ["folder_locked", "folder_locked"]


@pytest.mark.django_db
@pytest.mark.parametrize("body, status, code", [
    ({"machine": "gpu-pool"}, 400, "pool_unknown"),  # a pool name the owner never defined
    ({"machine": "gpu pool"}, 400, "invalid"),  # not even a pool name
    ({"machine": "ANY"}, 400, "invalid"),
    ({"machine": 7}, 400, "invalid"),
    ({"machine": None}, 400, "invalid"),
    ({"continue_task": str(uuid.uuid4())}, 400, "invalid"),  # a follow-up names its machine
    ({}, 409, "no_machine_available"),  # "any" with no machine at all
])
def test_c8_bad_any_requests_are_refused_and_change_nothing(owner, body, status, code, tmp_path):
    resp = submit_any(owner, tmp_path, **body)
    assert (resp.status_code, resp.json()["error"]) == (status, code), resp.content
    if code == "no_machine_available":
        assert resp.json()["machines"] == []
    assert nothing_written(owner)


# --- owner-named pools -------------------------------------------------------------------


def make_pool(owner, name, machines, status=201):
    resp = owner_api(owner).post("/api/pools/", {"name": name, "machines": [str(m.id) for m in machines]},
                                 format="json")
    assert resp.status_code == status, resp.content
    return resp.json()


@pytest.mark.django_db
def test_c8_a_task_naming_a_pool_runs_on_one_of_its_machines_by_the_any_rules(owner, make_machine, tmp_path):
    """The pick among the pool's machines only (least loaded, room, grant), recorded as the
    pool's name and replayed; when the pool's machines are full, 409 names only them,
    though a machine outside the pool has room."""
    laptop, desktop, build = (ready(make_machine(owner, n), max_concurrent=1) for n in ("laptop", "desktop", "build"))
    for m in (laptop, desktop, build):
        grant(m, tmp_path)
    make_pool(owner, "big-boxes", [desktop, build])
    first = submit_any(owner, tmp_path, key="p1", machine="big-boxes")
    assert first.status_code == 201, first.content
    assert (first.json()["machine"], first.json()["machine_choice"]) == (str(build.id), "big-boxes")  # a tie: by name
    second = submit_any(owner, tmp_path, machine="big-boxes")
    assert second.json()["machine"] == str(desktop.id)
    full = submit_any(owner, tmp_path, machine="big-boxes")
    assert (full.status_code, full.json()["error"]) == (409, "no_machine_available")
    assert [(m["name"], m["reason"]) for m in full.json()["machines"]] == [("build", "full"), ("desktop", "full")]
    replay = submit_any(owner, tmp_path, key="p1", machine="big-boxes")
    assert (replay.content, replay.headers["Idempotent-Replayed"]) == (first.content, "true")
    assert Task.objects.filter(machine=laptop).count() == 0
    assert set(Task.objects.values_list("machine_choice", flat=True)) == {"big-boxes"}


@pytest.mark.django_db
def test_c8_unknown_or_another_owners_pool_is_400_pool_unknown_and_writes_nothing(owner, other_owner, make_machine,
                                                                                   tmp_path):
    """K2: another owner's pool of that name is unknown here too (names leak nothing); an
    empty pool of the owner's is 409 with no machine to name."""
    mallory = ready(make_machine(other_owner, "mallory-box"))
    grant(mallory, tmp_path)
    make_pool(other_owner, "shared", [mallory])
    alice = ready(make_machine(owner, "laptop"))
    grant(alice, tmp_path)
    for name in ("shared", "nope"):
        resp = submit_any(owner, tmp_path, machine=name)
        assert (resp.status_code, resp.json()["error"]) == (400, "pool_unknown"), resp.content
        assert resp.json()["fields"] == {"machine": [f"no machine id, \"any\" or pool of yours: {name!r}"]}
    make_pool(owner, "empty", [])
    empty = submit_any(owner, tmp_path, machine="empty")
    assert (empty.status_code, empty.json()["error"], empty.json()["machines"]) == (409, "no_machine_available", [])
    assert nothing_written(owner)
    # the same key works once the cause is gone (A5: nothing stored)
    Task.objects.all().delete()
    assert submit_any(owner, tmp_path, machine="laptops", key="again").json()["error"] == "pool_unknown"
    make_pool(owner, "laptops", [alice])
    assert submit_any(owner, tmp_path, machine="laptops", key="again").status_code == 201


@pytest.mark.django_db
def test_c8_pools_api_create_list_rename_set_machines_delete(owner, other_owner, make_machine, tmp_path):
    api = owner_api(owner)
    laptop, desktop = ready(make_machine(owner, "laptop")), ready(make_machine(owner, "desktop"))
    grant(desktop, tmp_path)
    theirs = make_machine(other_owner, "theirs")
    pool = make_pool(owner, "gpu", [laptop])
    assert (pool["name"], pool["machines"]) == ("gpu", [str(laptop.id)])
    make_pool(owner, "gpu", [], status=409)  # pool_exists
    make_pool(other_owner, "gpu", [theirs])  # names are per owner
    resp = api.post("/api/pools/", {"name": "x", "machines": [str(theirs.id)]}, format="json")
    assert (resp.status_code, resp.json()["error"]) == (403, "machine_forbidden")
    for bad in ("any", "ANY", "Any", str(uuid.uuid4()), "1gpu", "a" * 65, "", "gpu pool", "gpu/1",
                "abcdef0123456789abcdef0123456789"):
        resp = api.post("/api/pools/", {"name": bad}, format="json")
        assert (resp.status_code, resp.json()["error"], list(resp.json()["fields"])) == (400, "invalid", ["name"]), bad
    listed = api.get("/api/pools/").json()
    assert [(p["name"], p["machines"]) for p in listed["results"]] == [("gpu", [str(laptop.id)])]
    assert listed["next"] is None
    changed = api.patch(f"/api/pools/{pool['id']}/", {"name": "desks", "machines": [str(desktop.id)]}, format="json")
    assert (changed.status_code, changed.json()["name"], changed.json()["machines"]) == (200, "desks", [str(desktop.id)])
    task = submit_any(owner, tmp_path, machine="desks").json()
    assert (task["machine"], task["machine_choice"]) == (str(desktop.id), "desks")
    assert submit_any(owner, tmp_path, machine="gpu").json()["error"] == "pool_unknown"  # renamed
    make_pool(owner, "other", [])
    clash = api.patch(f"/api/pools/{pool['id']}/", {"name": "other"}, format="json")
    assert (clash.status_code, clash.json()["error"]) == (409, "pool_exists")
    assert api.get(f"/api/pools/{pool['id']}/").json()["name"] == "desks"  # nothing changed
    assert api.delete(f"/api/pools/{pool['id']}/").status_code == 204
    assert api.get(f"/api/pools/{pool['id']}/").status_code == 404
    assert Task.objects.get(pk=task["id"]).machine_choice == "desks"  # history keeps the name
    assert Machine.objects.filter(pk=desktop.pk).exists()
    board = api.get("/api/board/").json()
    assert [p["name"] for p in board["pools"]] == ["other"]  # the owner's pools only


# --- live board events of pools (B2, issue 44) ---------------------------------------------


def pool_events(board_events, owner) -> list[dict]:
    return [e for e in board_events.of(owner) if e["type"] in ("pool", "pool.deleted")]


@pytest.mark.django_db
def test_b2_c8_pool_create_change_delete_reach_the_owners_board_group_with_rising_versions(
        owner, other_owner, make_machine, board_events, django_capture_on_commit_callbacks):
    """Each change is one event to the owner's group only, after commit, carrying the pool
    as ``GET /api/pools/{id}/`` shows it (a board rebuilds its task form from it) and a
    version above the last; deletion says which pool, one version higher still."""
    api = owner_api(owner)
    laptop, desktop = make_machine(owner, "laptop"), make_machine(owner, "desktop")
    board_events.clear()
    with django_capture_on_commit_callbacks(execute=True) as sent:
        created = api.post("/api/pools/", {"name": "gpu", "machines": [str(laptop.id)]}, format="json")
        assert board_events.of(owner) == []  # nothing before commit
    assert created.status_code == 201 and len(sent) == 1
    with django_capture_on_commit_callbacks(execute=True):
        renamed = api.patch(f"/api/pools/{created.json()['id']}/", {"name": "desks"}, format="json")
    with django_capture_on_commit_callbacks(execute=True):
        moved = api.patch(f"/api/pools/{created.json()['id']}/", {"machines": [str(desktop.id), str(laptop.id)]},
                          format="json")
    shown = api.get(f"/api/pools/{created.json()['id']}/").json()
    with django_capture_on_commit_callbacks(execute=True):
        assert api.delete(f"/api/pools/{created.json()['id']}/").status_code == 204
    events = pool_events(board_events, owner)
    assert [(e["type"], e["version"]) for e in events] == [("pool", 1), ("pool", 2), ("pool", 3), ("pool.deleted", 4)]
    assert [e["pool"] for e in events[:3]] == [created.json(), renamed.json(), moved.json()]
    assert events[2]["pool"] == shown
    assert (shown["name"], shown["machines"]) == ("desks", sorted([str(desktop.id), str(laptop.id)]))
    assert events[3]["pool_id"] == created.json()["id"]
    assert all(e["server_time"] for e in events)
    assert board_events.groups() == {owner_group(owner.pk)}  # K2: never another owner's
    assert board_events.of(other_owner) == []


@pytest.mark.django_db
def test_k2_another_owners_pool_calls_send_nothing_to_the_victims_board(
        owner, other_owner, make_machine, board_events, django_capture_on_commit_callbacks):
    """Mallory's PATCH and DELETE of Alice's pool are 404 and send nothing at all; her own
    pool's events go to her group only, though it has the same name as Alice's."""
    alice_pool = make_pool(owner, "desk", [make_machine(owner, "laptop")])
    theirs = make_machine(other_owner, "theirs")
    mallory = owner_api(other_owner)
    board_events.clear()
    with django_capture_on_commit_callbacks(execute=True):
        assert mallory.patch(f"/api/pools/{alice_pool['id']}/", {"name": "mine"}, format="json").status_code == 404
        assert mallory.delete(f"/api/pools/{alice_pool['id']}/").status_code == 404
    assert board_events.groups() == set()
    with django_capture_on_commit_callbacks(execute=True):
        mine = make_pool(other_owner, "desk", [theirs])
    assert board_events.groups() == {owner_group(other_owner.pk)}
    assert [e["pool"]["id"] for e in pool_events(board_events, other_owner)] == [mine["id"]]
    assert owner_api(owner).get(f"/api/pools/{alice_pool['id']}/").json() == alice_pool


@pytest.mark.django_db
@pytest.mark.parametrize("method, body, status, code", [
    ("post", {"name": "any"}, 400, "invalid"),
    ("post", {"name": "gpu", "extra": 1}, 400, "invalid"),  # K3: unknown field
    ("post", {"name": "gpu", "machines": "laptop"}, 400, "invalid"),  # K3: wrong JSON type
    ("post", {"name": "gpu", "machines": ["THEIRS"]}, 403, "machine_forbidden"),
    ("post", {"name": "desk"}, 409, "pool_exists"),
    ("patch", {}, 400, "invalid"),
    ("patch", {"name": "spare"}, 409, "pool_exists"),
    ("patch", {"machines": ["THEIRS"]}, 403, "machine_forbidden"),
    ("patch", {"name": 5}, 400, "invalid"),
    ("delete", {"force": True}, 400, "invalid"),
])
def test_k3_bad_pool_input_changes_nothing_and_sends_nothing(
        owner, other_owner, make_machine, board_events, django_capture_on_commit_callbacks, method, body, status, code):
    desk = make_pool(owner, "desk", [make_machine(owner, "laptop")])
    make_pool(owner, "spare", [])
    theirs = make_machine(other_owner, "theirs")
    body = {k: ([str(theirs.id)] if v == ["THEIRS"] else v) for k, v in body.items()}
    url = "/api/pools/" if method == "post" else f"/api/pools/{desk['id']}/"
    before = table_digest()
    board_events.clear()
    with django_capture_on_commit_callbacks(execute=True):
        resp = getattr(owner_api(owner), method)(url, body, format="json")
    assert (resp.status_code, resp.json()["error"]) == (status, code), resp.content
    assert table_digest() == before
    assert board_events.groups() == set()


def test_c8_remote_urls_normalised():
    same = ["git@github.com:Me/App.git", "https://github.com/me/app", "ssh://git@github.com:22/me/app.git/",
            "https://user:tok@github.com/me/app.git"]
    assert {normalize_remote(u) for u in same} == {"github.com/me/app"}
    assert normalize_remote("https://gitlab.com/me/app") != normalize_remote(same[0])
    assert strip_credentials("https://user:secret@host/r.git") == "https://host/r.git"
    assert strip_credentials("git@host:r.git") == "git@host:r.git"


def test_c8_worker_reports_roots_and_their_child_repositories(tmp_path):
    """The worker's report (machine/worker/repositories.py) with real git: a root that is
    a repository, a clone under another root (same root commit, its own path), a folder
    that is none, and no credentials in the remote."""
    def git(*args, cwd):
        subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                       env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                            "GIT_COMMITTER_EMAIL": "t@t", "HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})

    origin = tmp_path / "origin"
    origin.mkdir()
    git("init", "-q", cwd=origin)
    git("commit", "-q", "--allow-empty", "-m", "root", cwd=origin)
    git("remote", "add", "origin", "https://me:secret@example.com/me/app.git", cwd=origin)
    code = tmp_path / "code"
    (code / "plain").mkdir(parents=True)
    git("clone", "-q", str(origin), str(code / "app"), cwd=tmp_path)
    found = repository_identities([str(origin), str(code)])
    assert [r["path"] for r in found] == [str(code / "app"), str(origin)]
    clone, first = found
    assert clone["root_commit"] == first["root_commit"] and len(first["root_commit"]) == 40
    assert first["remote"] == "https://example.com/me/app.git"
    assert clone["remote"] == str(origin)


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_c8_racing_any_submits_never_overfill_a_machine(owner, make_machine, tmp_path):
    """Sixteen racing ``"any"`` submits for two machines of room 2 and 3: five accepted,
    eleven 409; the rows afterwards: no machine over its ``max_concurrent``."""
    laptop = ready(make_machine(owner, "laptop"), max_concurrent=2)
    desktop = ready(make_machine(owner, "desktop"), max_concurrent=3)
    for m in (laptop, desktop):
        grant(m, tmp_path)
    results = race(16, lambda i: submit_any(owner, tmp_path / f"f{i}").status_code)
    assert sorted(results) == [201] * 5 + [409] * 11
    assert {m: Task.objects.filter(machine=m).count() for m in (laptop, desktop)} == {laptop: 2, desktop: 3}
    assert IdempotencyRecord.objects.filter(owner=owner).count() == 5
    assert OutboxMessage.objects.filter(kind="start").count() == 5
    assert Budget.objects.get(owner=owner).reserved_s == 5 * 1800


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_c8_racing_pool_submits_never_overfill_its_machines_nor_leave_the_pool(owner, make_machine, tmp_path):
    """Ten racing submits naming a pool of two machines (room 2 and 1) beside a third
    machine with room: three accepted, all on the pool's machines, seven 409."""
    laptop = ready(make_machine(owner, "laptop"), max_concurrent=2)
    desktop = ready(make_machine(owner, "desktop"), max_concurrent=1)
    outside = ready(make_machine(owner, "outside"), max_concurrent=10)
    for m in (laptop, desktop, outside):
        grant(m, tmp_path)
    make_pool(owner, "pair", [laptop, desktop])
    results = race(10, lambda i: submit_any(owner, tmp_path / f"f{i}", machine="pair").status_code)
    assert sorted(results) == [201] * 3 + [409] * 7
    assert {m: Task.objects.filter(machine=m).count() for m in (laptop, desktop, outside)} == {
        laptop: 2, desktop: 1, outside: 0}
    assert Budget.objects.get(owner=owner).reserved_s == 3 * 1800


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_c8_p1_unpair_racing_any_submits_leaves_nothing_on_the_unpaired_machine(owner, make_machine, tmp_path):
    """P1 for a pick: an unpairing and racing ``"any"`` submits serialize; a task on the
    unpaired machine was accepted before it (and ends ``not_started``, P3), never after."""
    from tasks_app.services.revocation import machine_unpair

    laptop = ready(make_machine(owner, "laptop"), max_concurrent=50)
    desktop = ready(make_machine(owner, "desktop"), max_concurrent=50)
    for m in (laptop, desktop):
        grant(m, tmp_path)

    def work(i):
        if i == 0:
            machine_unpair(machine=Machine.objects.get(pk=desktop.pk), actor="owner", now=timezone.now())
            return None
        return submit_any(owner, tmp_path / f"f{i}").status_code

    results = race(12, work)
    assert results[1:] == [201] * 11
    on_desktop = Task.objects.filter(machine=desktop)
    assert set(on_desktop.values_list("state", flat=True)) <= {"not_started"}
    assert Task.objects.filter(machine=laptop).count() + on_desktop.count() == 11


# --- two real workers ----------------------------------------------------------------------


def _git(*args, cwd):
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                   env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                        "GIT_COMMITTER_EMAIL": "t@t", "HOME": str(cwd), "PATH": "/usr/bin:/bin"})


def _most_slots_held(machine_id) -> int:
    """The most slots the machine's tasks held at once, from their TaskEvents in the order
    they were written: a task holds one from its ``accepted`` event while its state is in
    LOAD_STATES (``unknown`` frees it, C8). Event ids, not their times: each operation
    reads ``now`` once, before it waits for the locks, so a row's time can precede that of
    a row written before it; a final that freed the slot an acceptance counted on was
    committed before that acceptance read, so its event id is the smaller."""
    holding, most = set(), 0
    for event in TaskEvent.objects.filter(task__machine_id=machine_id).exclude(new_state="").order_by("id"):
        if event.new_state in LOAD_STATES:
            holding.add(event.task_id)
        else:
            holding.discard(event.task_id)
        most = max(most, len(holding))
    return most


def test_c8_two_real_workers_share_ten_tasks_within_limits_and_an_unpaired_one_gets_nothing_new(
        module_daphne, transactional_db, make_owner, tmp_path):  # noqa: F811
    """Two real workers of one owner (``max_concurrent = 2`` each) with one repository at
    two paths (a clone): ten ``"any"`` tasks named by the first machine's path spread
    over both, each in its own machine's copy, never more than two accepted-and-unfinished
    per machine (rows afterwards); after the second machine is unpaired mid-way, every new
    task goes to the first and a refusal names the second ``unpaired``."""
    from tests.worker_harness import SHORT_TIMINGS, LiveSetup

    owner = make_owner()
    url = module_daphne(**SHORT_TIMINGS)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    one = LiveSetup(url, owner, tmp_path / "a", max_concurrent=2)
    two = LiveSetup(url, owner, tmp_path / "b", max_concurrent=2)
    try:
        _git("init", "-q", cwd=one.repo)
        _git("commit", "-q", "--allow-empty", "-m", "root", cwd=one.repo)
        _git("clone", "-q", str(one.repo), str(two.repo), cwd=tmp_path)
        for live in (one, two):
            live.start_worker()
        wait_for(lambda: all(Machine.objects.get(pk=live.machine_id).repositories for live in (one, two)),
                 timeout_s=30, what="both workers' repository reports")

        def submit():
            resp = one.api.post("/api/tasks/", headers={"Idempotency-Key": str(uuid.uuid4())}, json={
                "machine": "any", "folder": str(one.repo), "agent": "brief", "prompt": "go", "exclusive": False})
            assert resp.status_code in (201, 409), resp.text
            return resp.json() if resp.status_code == 201 else None

        accepted = []

        def submit_when_room():
            return submit()

        for _ in range(5):
            accepted.append(wait_for(submit_when_room, timeout_s=30, interval_s=0.2, what="room on a machine"))
        assert {t["machine"] for t in accepted} == {one.machine_id, two.machine_id}
        assert {t["folder"] for t in accepted if t["machine"] == two.machine_id} == {str(two.repo)}
        assert one.api.post(f"/api/machines/{two.machine_id}/unpair/").status_code == 200
        later = [wait_for(submit_when_room, timeout_s=30, interval_s=0.2, what="room on the first machine")
                 for _ in range(5)]
        assert {t["machine"] for t in later} == {one.machine_id}
        for task in later:
            one.wait_final(task["id"], timeout=60)
        # P3: the unpaired machine's work stops; a task it ran ends unknown (its lease
        # refused, its worker's token revoked), one it never started not_started.
        for task in accepted:
            one.wait_state(task["id"], FINAL_OR_UNKNOWN, timeout=60)
        assert all(one.task(t["id"])["state"] == "succeeded" for t in later)
        # Never more than max_concurrent tasks holding a slot per machine, from the rows.
        for live in (one, two):
            assert 1 <= _most_slots_held(live.machine_id) <= 2, live.machine_id
        # A refusal after the unpairing says why, per machine.
        full = one.api.post("/api/tasks/", headers={"Idempotency-Key": str(uuid.uuid4())}, json={
            "machine": "any", "folder": str(one.repo), "agent": "absent", "prompt": "go"})
        reasons = {m["id"]: m["reason"] for m in full.json()["machines"]}
        assert reasons == {one.machine_id: "profile_not_reported", two.machine_id: "unpaired"}
    finally:
        one.close()
        two.close()
