"""The main job end to end (issue 2): a real daphne server, a real paired worker process,
a real task over HTTP, and the board's WebSocket seeing it move (SPEC 2, B2, H, O4)."""
import os
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest

from tests.live import BASE_DIR, BoardSocket, database_env, live_daphne  # noqa: F401
from tests.wait import wait_for
from tests.worker_harness import SHORT_TIMINGS


def manage(*args, env=None, **kwargs):
    full_env = {**os.environ, **database_env(), **(env or {})}
    return subprocess.run([sys.executable, "manage.py", *args], cwd=BASE_DIR, env=full_env, **kwargs)


def make_repo(path: Path) -> Path:
    path.mkdir()
    (path / "calc.py").write_text("def add(a, b):\n    return a + b\n")
    (path / "test_calc.py").write_text(
        "import unittest\nfrom calc import add\n\n"
        "class T(unittest.TestCase):\n    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n"
    )
    subprocess.run(["git", "init", "-q", str(path)], check=True)
    return path


@pytest.mark.slow
def test_o1_h_task_runs_end_to_end_with_real_worker_and_board_events(live_daphne, make_owner, tmp_path):  # noqa: F811
    owner = make_owner("e2e")
    token = owner.auth_token.key
    url = live_daphne(**SHORT_TIMINGS)
    api = httpx.Client(base_url=url, headers={"Authorization": f"Token {token}"}, timeout=10)

    code = api.post("/api/machines/pairing-codes/", json={"name": "e2e-laptop"}).json()["code"]
    state_dir = tmp_path / "state"
    manage("pair_worker", "--server", url, "--code", code, "--state-dir", str(state_dir), check=True, capture_output=True)
    machine_id = api.get("/api/machines/").json()["results"][0]["id"]
    repo = make_repo(tmp_path / "repo")
    assert api.post("/api/grants/", json={"machine": machine_id, "path": str(repo)}).status_code == 201

    config = tmp_path / "worker.toml"
    config.write_text(
        f'allowed_roots = ["{repo}"]\n\n[profiles.demo]\n'
        f'argv = ["{sys.executable}", "{BASE_DIR / "scripts" / "demo_agent.py"}", "{{prompt}}"]\n'
        'env = { DEMO_ROUNDS = "2", DEMO_PAUSE_S = "0.5" }\n'
    )
    board = BoardSocket(url, token)
    board.start()
    assert board.connected.wait(10)
    worker_log = open(tmp_path / "worker.log", "wb")
    worker = subprocess.Popen(
        [sys.executable, "manage.py", "worker", "--server", url, "--state-dir", str(state_dir), "--config", str(config)],
        cwd=BASE_DIR, env={**os.environ, **database_env(), "RUNSTEAD_WORKER_POLL_S": "1"},
        stdout=worker_log, stderr=subprocess.STDOUT,
    )
    try:
        resp = api.post(
            "/api/tasks/",
            json={"machine": machine_id, "folder": str(repo), "agent": "demo", "prompt": "run the tests"},
            headers={"Idempotency-Key": str(uuid.uuid4())},
        )
        assert resp.status_code == 201, resp.text
        task_id = resp.json()["id"]
        task = wait_for(lambda: api.get(f"/api/tasks/{task_id}/").json(),
                        until=lambda t: t["state"] not in ("accepted", "delivered", "starting", "running"),
                        timeout_s=60, interval_s=0.2, what="the task to end",
                        detail=lambda: (tmp_path / "worker.log").read_text()[-3000:])
        assert task["state"] == "succeeded", (task, (tmp_path / "worker.log").read_text()[-3000:])
        assert task["exit_code"] == 0 and task["stop_reason"] == "exit"
        assert "tests exit 0" in (repo / "NOTES.md").read_text()
        assert [r["kind"] for r in reversed(task["receipts"])][:3] == ["starting", "running", "final"]
        def seen_states():
            return [e["task"]["state"] for e in board.events if e.get("type") == "task" and e["task"]["id"] == task_id]

        wait_for(lambda: "succeeded" in seen_states(), timeout_s=5, what="the board's succeeded event")
        seen = seen_states()
        assert seen[0] == "accepted" and seen[-1] == "succeeded"
        assert {"starting", "running"} <= set(seen)
        versions = [e["version"] for e in board.events if e.get("type") == "task" and e["task"]["id"] == task_id]
        assert versions == sorted(versions)
    finally:
        worker.terminate()
        worker.wait(timeout=15)
        board.stop()
        api.close()
