"""Live progress from the worker (SPEC G4, W8) in-process against ``InMemoryService``
with the system clock and short lease terms (a real agent: scripts/fake_claude.py
speaking Claude's stream-json). A progress endpoint that never answers delays no
renewal and no receipt; progress goes at most once a second and only on change."""
from __future__ import annotations

import threading
import tomllib
import uuid
from pathlib import Path

import pytest

from machine.worker.clock import SYSTEM_CLOCK
from machine.worker.config import parse_config
from machine.worker.loop import Worker, WorkerOptions
from machine.worker.store import StateDir, Store
from machine.worker.testing import InMemoryService
from tests.wait import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.backend_independent]  # neither database nor layer (pytest.ini)

FAKE_CLAUDE = Path(__file__).resolve().parent.parent / "scripts" / "fake_claude.py"
TERMS = {"duration_s": 3.0, "renew_every_s": 0.5, "margin_s": 0.5, "kill_grace_s": 0.5}


def make(tmp_path: Path, service: InMemoryService, *, pause_s: float, turns: int) -> tuple[Worker, Path]:
    root = tmp_path / "root"
    repo = root / "repo"
    repo.mkdir(parents=True)
    state = StateDir(str(tmp_path / "state"))
    state.ensure()
    state.write_identity(machine_id=str(uuid.uuid4()), generation=1, name="unit", server="memory://",
                         token="tok-" + uuid.uuid4().hex)
    config = parse_config(tomllib.loads(
        f'allowed_roots = ["{root}"]\n[profiles.claude]\npreset = "claude"\nbinary = "{FAKE_CLAUDE}"\n'
        f'env = {{ FAKE_CLAUDE_PAUSE_S = "{pause_s}", FAKE_CLAUDE_TURNS = "{turns}", FAKE_CLAUDE_COMMIT = "0" }}\n'))
    worker = Worker(state=state, store=Store(state.db_path), identity=state.read_identity(), config=config,
                    options=WorkerOptions(server="memory://", poll_wait_s=0.2), clock=SYSTEM_CLOCK,
                    connect=lambda: service)
    return worker, repo


def run(worker: Worker) -> threading.Thread:
    thread = threading.Thread(target=worker.run, name="main", daemon=True)
    thread.start()
    return thread


def stop(worker: Worker, thread: threading.Thread) -> None:
    worker.on_signal()
    worker.on_signal()
    thread.join(timeout=15)


def test_g4_w8_a_progress_call_that_never_answers_delays_no_renewal_and_no_receipt(tmp_path):
    service = InMemoryService(SYSTEM_CLOCK, **TERMS)
    service.progress_gate.clear()  # every progress call hangs until the test lets it go
    worker, repo = make(tmp_path, service, pause_s=0.4, turns=6)  # ~2.4 s: several renewals
    thread = run(worker)
    try:
        start = service.add_start(folder=str(repo), grant_root=str(repo.parent), agent="claude")
        final = wait_for(lambda: service.receipt(start.operation_id, "final"), timeout_s=20, what="final receipt")
        # The progress thread is stuck inside its first call the whole time.
        assert service.progress_posts == [] and worker.progress.sent == 0
        facts = final["facts"]
        assert (facts["stop_reason"], facts["exit_code"], facts["ended_within_lease"]) == ("exit", 0, True)
        assert facts["usage"]["turns"] == 6
        renewals = [c for c in service.calls_to("renew")]
        assert len(renewals) >= 3 and {c.status for c in renewals} == {200}
        sends = [c.at for c in service.calls_to("grant")] + [c.at for c in renewals]
        gaps = [b - a for a, b in zip(sends, sends[1:])]
        assert max(gaps) < TERMS["renew_every_s"] + 0.4, gaps  # on schedule (L3, W8)
    finally:
        service.progress_gate.set()
        stop(worker, thread)


def test_g4_progress_at_most_once_a_second_and_only_on_change(tmp_path):
    service = InMemoryService(SYSTEM_CLOCK, **TERMS)
    worker, repo = make(tmp_path, service, pause_s=0.25, turns=12)  # an event every 0.25 s for ~3 s
    thread = run(worker)
    try:
        start = service.add_start(folder=str(repo), grant_root=str(repo.parent), agent="claude")
        wait_for(lambda: service.receipt(start.operation_id, "final"), timeout_s=20, what="final receipt")
    finally:
        stop(worker, thread)
    posts = service.progress_posts
    assert len(posts) >= 2, posts
    times = [t for t, _ in posts]
    assert min(b - a for a, b in zip(times, times[1:])) >= 0.95  # at most once a second
    bodies = [b for _, b in posts]
    assert [b["seq"] for b in bodies] == sorted({b["seq"] for b in bodies})  # rising, no repeats
    for before, after in zip(bodies, bodies[1:]):  # each one says something new
        assert {k: before[k] for k in ("output_tail", "last_message", "usage")} != \
               {k: after[k] for k in ("output_tail", "last_message", "usage")}
    assert set(bodies[0]) == {"operation_id", "seq", "output_tail", "last_message", "usage", "entries"}
    assert bodies[-1]["usage"]["turns"] > bodies[0]["usage"]["turns"]
    # Fewer posts than changes: the newest offer replaced the older ones (a slot, not a queue).
    assert len(posts) < 12


def test_g4_progress_posts_and_the_final_receipt_carry_the_whole_transcript_once(tmp_path):
    """Entries go with progress while the agent runs; those no post delivered (the last
    ones, within a second of the exit) go with the final receipt: together the transcript
    from the prompt to the last message, numbered 1..N without a gap."""
    service = InMemoryService(SYSTEM_CLOCK, **TERMS)
    worker, repo = make(tmp_path, service, pause_s=0.3, turns=4)
    thread = run(worker)
    try:
        start = service.add_start(folder=str(repo), grant_root=str(repo.parent), agent="claude", prompt="tidy up")
        final = wait_for(lambda: service.receipt(start.operation_id, "final"), timeout_s=20, what="final receipt")
    finally:
        stop(worker, thread)
    posted = [e for _, body in service.progress_posts for e in body["entries"]]
    assert posted, "entries went with progress while the agent ran"
    transcript = {e["n"]: e for e in posted + final["facts"]["entries"]}
    assert sorted(transcript) == list(range(1, len(transcript) + 1))
    kinds = [transcript[n]["kind"] for n in sorted(transcript)]
    # prompt, then per turn a message and (but the last) a Bash call with its result
    assert kinds == ["prompt"] + ["message", "tool_call", "tool_result"] * 3 + ["message"]
    assert transcript[1]["text"] == "tidy up"
    assert transcript[len(transcript)]["text"].startswith("Done:")
    call = transcript[3]
    assert (call["tool"], call["text"]) == ("Bash", "git status --short")
    assert transcript[4]["call"] == 3 and transcript[4]["status"] in ("ok", "error")
    assert transcript[2]["usage"] == {"input_tokens": 2000, "output_tokens": 70}
    # the final carries the tail that no confirmed post delivered, not the whole run again
    tail = [e["n"] for e in final["facts"]["entries"]]
    assert tail and tail == list(range(tail[0], len(transcript) + 1)) and tail[0] > 1
