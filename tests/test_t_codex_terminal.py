"""SPEC T3 with the real Codex terminal UI (0.169.0) inside the wrapper
(``scripts/runstead-term codex``), offline against the fake Responses API
(``tests.model_apis.ResponsesAPI``), under tmux, its hooks installed by
``install_hooks codex --machine`` and trusted for the run
(``--dangerously-bypass-hook-trust``; the wrapper adds ``--no-daemon``, so the turns and
their hooks run in its own pseudo-terminal's process): a message sent while the session is idle is typed
at its prompt once and answered; the message ends ``answered``.
"""
import json
import os
import sys
import uuid
from pathlib import Path

import httpx
import pytest

from machine.hooks.install import install
from machine.hooks.mapping import CODEX_TITLE_REQUEST
from machine.worker import sessions
from sessions_app.models import Session, SessionMessage
from tests.agent_clis import cli_bin, offline
from tests.conftest import machine_api
from tests.hooks_support import stop_sender, wrapper_state
from tests.model_apis import ResponsesAPI
from tests.tmux import Terminal
from tests.wait import wait_for

def wrapped_session(state_dir: Path) -> str | None:
    """The RunStead session id the terminal wrapper under ``state_dir`` has learned, or None."""
    for path in (state_dir / "terminals").glob("*/state.json"):
        if session_id := json.loads(path.read_text()).get("session_id"):
            return session_id
    return None


pytestmark = [pytest.mark.surface, pytest.mark.slow, pytest.mark.django_db(transaction=True)]
ROOT = Path(__file__).resolve().parent.parent


def test_t3_real_codex_tui_in_the_wrapper_a_message_is_typed_and_answered_once(live_server, owner, machine, tmp_path):
    home, work, state_dir = tmp_path / "home", tmp_path / "work", tmp_path / "home" / ".runstead" / "hooks"
    work.mkdir(parents=True)
    with ResponsesAPI() as api:
        setup = offline("codex", home, api)
        install("codex", server=live_server.url, token=owner.auth_token.key, config_dir=home / ".codex",
                state_dir=state_dir, machine=str(machine.id))
        env = {**setup.env, "PATH": os.environ["PATH"], "TERM": "xterm-256color", "RUNSTEAD_HOOK_SENDER_IDLE_S": "10",
               "RUNSTEAD_TERMINAL_QUIET_S": "0.5", "RUNSTEAD_PYTHON": sys.executable, "RUNSTEAD_HOOK_DIR": str(state_dir)}
        argv = [str(ROOT / "scripts" / "runstead-term"), cli_bin("codex"), "--dangerously-bypass-hook-trust"]
        term = Terminal(tmp_path / "tmux.sock", argv, env=env, cwd=work)
        try:
            term.wait_for("Ask Codex to do anything", timeout=60)  # keys typed before are lost to its start-up
            # the wrapper learns the session from the first turn's hooks (SessionStart fires with it)
            term.submit("a desk turn", accepted=lambda: "ok: a desk turn" in term.screen(), settle_s=20)
            # the session the wrapper runs (its state.json)
            session = wait_for(lambda: Session.objects.filter(pk=wrapped_session(state_dir), owner=owner, agent="codex",
                                                              channel="terminal", machine=machine).first(),
                               timeout_s=30, what="the wrapper's terminal session on the service",
                               detail=lambda: wrapper_state(state_dir))
            sent = httpx.post(f"{live_server.url}/api/sessions/{session.pk}/messages/", json={"text": "from the phone"},
                              headers={"Authorization": f"Token {owner.auth_token.key}",
                                       "Idempotency-Key": str(uuid.uuid4())}, timeout=20)
            assert sent.status_code == 201, sent.text
            for message in machine_api(machine).get("/api/worker/messages/?wait=0").json()["messages"]:
                sessions.record(message["kind"], message["payload"], state_dir=str(state_dir))
            term.wait_for("ok: from the phone", timeout=60, detail=lambda: wrapper_state(state_dir))
            wait_for(lambda: SessionMessage.objects.get(pk=sent.json()["id"]).state == "answered", timeout_s=30,
                     what="the message answered")
            asked = [api.conversation(body)[0] for path, body in api.requests if path.startswith("/v1/responses")]
            assert asked.count("from the phone") == 1, asked
            # Codex's title thread ran after each user turn (the fake's answer is no title, so
            # it tries again), and its notify made no session: one Codex session, the user's.
            assert sum(text.startswith(CODEX_TITLE_REQUEST) for text in asked) == 2, asked
            assert list(Session.objects.filter(owner=owner, agent="codex").values_list("pk", flat=True)) == [session.pk]
        finally:
            term.close()
            stop_sender(state_dir)
