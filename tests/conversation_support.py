"""Helpers for the live-conversation tests (SPEC C): a real worker running the real Claude
Code in streaming-input mode against the fake Messages API, or the real Codex app-server
against the fake Responses API (tests/model_apis.py)."""
from __future__ import annotations

import json
import os
import subprocess
import uuid
from pathlib import Path

import psutil

from tests.agent_clis import offline
from tests.claude_cli import write_claude_profile
from tests.model_apis import AnthropicAPI, ChatAPI, ResponsesAPI, steer_notes
from tests.wait import wait_for
from tests.worker_harness import SHORT_TIMINGS, LiveSetup


def conversation_setup(url: str, owner, tmp_path, api: AnthropicAPI, *, worker_fault: str | None = None) -> LiveSetup:
    """A paired worker whose ``claude`` profile is the real CLI (``conversation`` live by
    its preset), started with fault point ``worker_fault`` if given (``machine.worker.
    faults``); returns once the service knows the profile can converse live."""
    setup = LiveSetup(url, owner, tmp_path)
    subprocess.run(["git", "init", "-q", str(setup.repo)], check=True)
    write_claude_profile(setup, api=api, home=tmp_path / "home",
                         options='extra_args = ["--permission-mode", "bypassPermissions"]\n')
    setup.start_worker(fault=worker_fault)
    wait_live_profile(setup)
    return setup


def codex_conversation_setup(url: str, owner, tmp_path, api: ResponsesAPI) -> LiveSetup:
    """A paired worker whose ``codex`` profile is the real Codex CLI offline against
    ``api`` (``conversation`` live by its preset: ``codex app-server``, C11); returns once
    the service knows the profile can converse live."""
    return _offline_setup("codex", url, owner, tmp_path, api)


def opencode_conversation_setup(url: str, owner, tmp_path, api: ChatAPI, *, options: str = "",
                                env: dict | None = None) -> LiveSetup:
    """A paired worker whose ``opencode`` profile is the real opencode offline against
    ``api`` (``conversation`` live by its preset: ``opencode serve`` behind
    machine/opencode_bridge.py, C11), with the profile's TOML lines ``options`` (e.g.
    ``approvals = "ask"``) and more ``env`` (e.g. ``OPENCODE_CONFIG_CONTENT``); returns
    once the service knows the profile can converse live."""
    return _offline_setup("opencode", url, owner, tmp_path, api, options=options, env=env)


# opencode's own configuration (merged over the offline one, docs/opencode-server.md): its
# bash tool asks for permission (``permission.asked``) instead of running at once.
OPENCODE_BASH_ASKS = {"OPENCODE_CONFIG_CONTENT": json.dumps({"permission": {"bash": "ask"}})}


def _offline_setup(preset: str, url: str, owner, tmp_path, api, *, options: str = "",
                   env: dict | None = None) -> LiveSetup:
    """A paired worker whose profile ``preset`` (of that preset) is the real CLI offline
    against ``api`` (tests/agent_clis.py), once the service knows it can converse live."""
    setup = LiveSetup(url, owner, tmp_path)
    subprocess.run(["git", "init", "-q", str(setup.repo)], check=True)
    profile = offline(preset, tmp_path / "home", api).profile()
    env = ", ".join(f"{key} = {json.dumps(value)}" for key, value in {**profile["env"], **(env or {})}.items())
    setup.config.write_text(f'allowed_roots = ["{setup.root}"]\n[profiles.{preset}]\npreset = "{preset}"\n'
                            f'binary = {json.dumps(profile["binary"])}\nenv = {{ {env} }}\n{options}')
    setup.start_worker()
    wait_live_profile(setup)
    return setup


# A tool call that runs 45 s (a turn that is still running when the test acts on it).
LONG_TOOL = '[[bash:python3 -c "import time; time.sleep(45)"; echo slept]] long tool'
# A lease that outlives a renewal delayed by a loaded machine (a real CLI starting is heavy).
LIVE_CLI_TIMINGS = {**SHORT_TIMINGS, "RUNSTEAD_LEASE_DURATION_S": "20", "RUNSTEAD_LEASE_RENEW_S": "1"}


def long_tool_runs() -> bool:
    """Whether a ``LONG_TOOL`` command runs on this machine now."""
    for p in psutil.process_iter():
        try:
            if "time.sleep(45)" in " ".join(p.cmdline()):
                return True
        except psutil.Error:
            continue
    return False


def opencode_turns_started(api: ChatAPI) -> list[str]:
    """The user texts that started a model turn, in the order the fake Chat Completions API
    saw them: a request offering tools (not a title call) whose last user text has no tool
    result after it."""
    out = []
    for path, body in api.requests:
        if path.startswith("/v1/chat/completions") and body.get("tools"):
            prompt, tools_done = ChatAPI.conversation(body)
            if tools_done == 0:
                out.append(prompt)
    return out


def codex_turns_started(api: ResponsesAPI) -> list[str]:
    """The user texts that started a model turn, in the order the fake Responses API saw
    them: a request whose last user text has no tool output after it."""
    out = []
    for path, body in api.requests:
        if path.startswith("/v1/responses"):
            prompt, tools_done = ResponsesAPI.conversation(body)
            if tools_done == 0:
                out.append(prompt)
    return out


FAKE_CLAUDE = Path(__file__).resolve().parent.parent / "scripts" / "fake_claude.py"


def fake_claude_setup(url, owner, tmp_path, *, pause_s: float = 1.2, slow_prompt: str = "") -> LiveSetup:
    """The demo's live profile: ``fake-claude`` (the claude preset run by
    scripts/fake_claude.py, which converses over stream-json input as Claude Code does);
    each turn is two assistant turns ``pause_s`` apart with a read-only tool call; a
    message containing ``slow_prompt`` holds 30 s after its tool call (a turn to stop)."""
    setup = LiveSetup(url, owner, tmp_path)
    subprocess.run(["git", "init", "-q", str(setup.repo)], check=True)
    setup.config.write_text(
        f'allowed_roots = ["{setup.root}"]\n[profiles.fake-claude]\npreset = "claude"\nbinary = "{FAKE_CLAUDE}"\n'
        f'env = {{ FAKE_CLAUDE_PAUSE_S = "{pause_s}", FAKE_CLAUDE_TURNS = "2", FAKE_CLAUDE_COMMIT = "0", '
        f'FAKE_CLAUDE_SLOW_PROMPT = "{slow_prompt}" }}\n')
    setup.start_worker()
    wait_live_profile(setup)
    return setup


def session_status(setup: LiveSetup, session_id: str) -> str:
    resp = setup.api.get(f"/api/sessions/{session_id}/")
    assert resp.status_code == 200, resp.text
    return resp.json()["status"]


def idle_notices(session_id: str) -> int:
    """N1 "session idle" notifications written for the session (one per true turn end)."""
    from notifications.models import Kind, Notification

    return Notification.objects.filter(kind=Kind.SESSION_IDLE, event_key__startswith=f"session:{session_id}:idle:").count()


def wait_live_profile(setup: LiveSetup) -> None:
    """Until the service knows one of the worker's profiles can converse live (C1)."""
    from tasks_app.models import Machine

    wait_for(lambda: any(p.get("conversation") == "live"
                         for p in Machine.objects.get(pk=setup.machine_id).profiles or []),
             timeout_s=30, what="the worker reported its live profile")


def op_dir(setup: LiveSetup, task_id: str) -> str:
    """The worker's directory of the task's operation (launcher.json, output.log, inbox)."""
    from tasks_app.models import Operation

    return os.path.join(setup.state_dir, "ops", str(Operation.objects.get(task_id=task_id).id))


def open_conversation(setup: LiveSetup, prompt: str) -> str:
    """Submit a conversation task to the real CLI; its id."""
    return setup.submit("claude", prompt=prompt, mode="conversation")


def send(setup: LiveSetup, task_id: str, text: str, key: str | None = None, delivery: str | None = None):
    """``POST /api/tasks/{id}/messages/`` (``delivery``: C9's ``steer`` or ``queue``,
    absent when None); the httpx response."""
    body = {"text": text} if delivery is None else {"text": text, "delivery": delivery}
    return setup.api.post(f"/api/tasks/{task_id}/messages/", json=body,
                          headers={"Idempotency-Key": key or str(uuid.uuid4())})


def messages(setup: LiveSetup, task_id: str) -> list[dict]:
    resp = setup.api.get(f"/api/tasks/{task_id}/messages/")
    assert resp.status_code == 200, resp.text
    return resp.json()["results"]


def wait_states(setup: LiveSetup, task_id: str, want: dict[int, str], timeout: float = 60) -> list[dict]:
    """Until each message ``seq`` in ``want`` is in its state; the messages."""
    def reached(got: list[dict]) -> bool:
        states = {m["seq"]: m["state"] for m in got}
        return all(states.get(seq) == state for seq, state in want.items())

    return wait_for(lambda: messages(setup, task_id), until=reached, timeout_s=timeout,
                    what=f"the messages to reach {want}", detail=lambda: f"--- worker log ---\n{setup.log()}")


def turns_started(api: AnthropicAPI) -> list[str]:
    """The user texts that started a turn, in the order the model API saw them: a request
    whose last user prompt has no tool result after it (``AnthropicAPI.conversation``)."""
    out = []
    for path, body in api.requests:
        if path.startswith("/v1/messages") and "count_tokens" not in path:
            prompt, tools_done = AnthropicAPI.conversation(body)
            if tools_done == 0 and body.get("messages"):
                out.append(prompt)
    return out


def user_texts_in_last_request(api: AnthropicAPI) -> list[str]:
    """Every user text block of the last Messages request (the whole conversation as the
    agent holds it), system reminders left out, and every message the user sent mid-turn
    (C9: ``model_apis.steer_notes``), in the order the request holds them."""
    bodies = [b for p, b in api.requests if p.startswith("/v1/messages") and "count_tokens" not in p]
    texts = []
    for message in bodies[-1].get("messages") or []:
        if message.get("role") == "system":
            texts += steer_notes(message)
        if message.get("role") != "user":
            continue
        content = message.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        texts += [b["text"] for b in blocks if b.get("type") == "text"
                  and not b.get("text", "").startswith("<system-reminder>")]
    return texts


def opencode_servers(processes) -> list[psutil.Process]:
    """Those of ``processes`` that are an ``opencode serve`` (the npm package's binary). A
    server's own children between fork and exec (the commands it runs: git, the shell)
    show the same command line for a moment, and one that ended may be a zombie not yet
    reaped: neither is a second server, and both are left out (seen in runs of the X3 and
    L4 tests)."""
    def is_server(p: psutil.Process) -> bool:
        try:
            cmdline = p.cmdline()
        except psutil.Error:
            return False
        return cmdline[1:2] == ["serve"] and "opencode" in cmdline[0]

    found = []
    for p in processes:
        try:
            if is_server(p) and not is_server(p.parent()):
                found.append(p)
        except (psutil.Error, AttributeError):  # gone, or no parent left
            continue
    return found
