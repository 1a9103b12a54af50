"""The worker's side of a worktree task's follow-up (SPEC G7, G8, W4), in-process against
``InMemoryService`` with a ``FakeClock`` and the test agent (tests/agents/agent.py) in a
real git repository: a ``start`` naming ``worktree_of`` runs in that operation's
worktree, on its branch, with G5 counting its own commits; a worktree this worker has no
record of (or that is gone) refuses the start with ``refused_reason:
worktree_unavailable``."""
from __future__ import annotations

import json
import shutil
import threading

import pytest

from machine.worker.clock import FakeClock
from machine.worker.loop import WorkerOptions
from machine.worker.testing import InMemoryService
from tests.git_support import git
from tests.wait import wait_for
from tests.worker_harness import make_worker

pytestmark = pytest.mark.backend_independent  # neither database nor layer (pytest.ini)

PROFILES = {"instant": {"AGENT_SLEEP_S": "0"}}


@pytest.fixture
def rig(tmp_path):
    root = tmp_path / "root"
    repo = root / "repo"
    repo.mkdir(parents=True)
    git(repo, "init", "-q", "-b", "main")
    (repo / "README").write_text("hello\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "initial")
    clock = FakeClock()
    service = InMemoryService(clock)

    def run_once() -> None:
        worker = make_worker(tmp_path, clock, roots=[str(root)], connect=lambda: service, profiles=PROFILES,
                             options=WorkerOptions(server="memory://", once=True, poll_wait_s=0))
        result: list = []
        thread = threading.Thread(target=lambda: result.append(worker.run()), daemon=True)
        thread.start()
        thread.join(timeout=60)
        assert result, "the --once worker did not finish"

    def start(prompt: str, **payload) -> str:
        message = service.add_start(folder=str(repo), grant_root=str(root), agent="instant", prompt=prompt,
                                    isolation="worktree")
        message.payload.update(payload)
        return message.operation_id

    def final(operation_id: str) -> dict:
        return wait_for(lambda: service.receipt(operation_id, "final"), timeout_s=30, what="final receipt")["facts"]

    return type("Rig", (), {"repo": repo, "state": tmp_path / "state", "run_once": staticmethod(run_once),
                            "start": staticmethod(start), "final": staticmethod(final)})


def test_g8_g7_a_follow_up_runs_in_the_worktree_and_on_the_branch_of_the_task_it_follows(rig):
    first = rig.start("[[write:a.txt:one\\n]][[commit:first]]")
    rig.run_once()
    one = rig.final(first)["evidence"]["git"]
    follow = rig.start("[[write:b.txt:two\\n]][[commit:second]]", worktree_of=first)
    rig.run_once()
    two = rig.final(follow)["evidence"]["git"]
    assert two["branch"] == one["branch"] and two["base"] == one["base"]
    assert (two["start_head"], two["commits"], two["subjects"]) == (one["end_head"], 1, ["second"])
    assert [f["path"] for f in two["files"]] == ["a.txt", "b.txt"]  # the branch against its base
    assert git(rig.repo, "log", "--format=%s", two["branch"]).splitlines() == ["second", "first", "initial"]
    assert len(list((rig.state / "worktrees").iterdir())) == 1  # no second worktree


@pytest.mark.parametrize("case", ["unknown operation", "worktree removed"])
def test_g8_a_follow_up_without_its_worktree_is_refused_worktree_unavailable(rig, case):
    first = rig.start("[[write:a.txt:one\\n]]")
    rig.run_once()
    rig.final(first)
    if case == "worktree removed":
        shutil.rmtree(next((rig.state / "worktrees").iterdir()))
        target = first
    else:
        target = "00000000-0000-4000-8000-000000000000"
    follow = rig.start("more", worktree_of=target)
    rig.run_once()
    facts = rig.final(follow)
    assert (facts["process_started"], facts["stop_reason"], facts["refused_reason"]) == (
        False, "refused", "worktree_unavailable"), json.dumps(facts)[:500]


def test_g8_w1_the_records_of_a_worktree_shared_by_follow_ups_go_once_its_one_integration_is_done(rig):
    from machine.worker.store import Store

    first = rig.start("[[write:a.txt:one\\n]][[commit:first]]")
    rig.run_once()
    rig.final(first)
    follow = rig.start("[[write:b.txt:two\\n]]", worktree_of=first)
    rig.run_once()
    rig.final(follow)
    store = Store(str(rig.state / "worker.sqlite3"))
    try:
        far = 4_000_000_000.0
        assert store.prune(before_wall=far) == []  # undecided: both kept
        store.record_integration(message_id="m-1", integration_id="i-1", operation_id=follow,
                                 payload={"action": "discard"}, wall=1.0)
        assert store.prune(before_wall=far) == []  # decided, not done yet
        store.integration_done("i-1", outcome={"outcome": "discarded"}, wall=1.0, outbox=[])
        assert sorted(store.prune(before_wall=far)) == sorted([first, follow])  # the one decision covers both
    finally:
        store.close()
