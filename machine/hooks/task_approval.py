"""The waiting ``PermissionRequest`` hook of a headless task (SPEC Q5, Q3).

A worker that runs a task whose profile says ``approvals = "ask"`` adds, for that run
only, a ``PermissionRequest`` hook running ``python -m machine.hooks claude --task``
and puts in the agent's environment (W5: never an owner or machine token):

- ``RUNSTEAD_TASK_CREDENTIAL``: the task's approval credential (``Authorization: Task``),
  which can create approvals of that task and read them, nothing else;
- ``RUNSTEAD_TASK_SERVER``: the service's base URL;
- ``RUNSTEAD_TASK_ID``: the task (set for every task);
- ``RUNSTEAD_TASK_HOOK_DIR``: a 0700 folder of the run (the per-turn request counts,
  ``hook.log``);
- ``RUNSTEAD_HOOK_APPROVAL_WAIT_S``: the longest it waits (the service's
  ``approval_wait_s`` plus a margin, so the service's expiry is what it sees).

Inside a task (``RUNSTEAD_TASK_ID`` set) only that entry asks: a ``PermissionRequest`` entry of the
owner's own configuration (``install_hooks``, for interactive sessions) prints nothing at
once there, so one request is asked once and never with the owner's token; so does the
run's entry without a credential (``approvals = "off"``): the CLI denies as with no hook.

``ask(payload, environ)`` is the interactive hook's asking and waiting
(``machine.hooks.approval``: ``Asker``, ``decision_output``, the same settings and
unreachable window) with three differences: it authenticates with ``Authorization: Task``,
names no session (the credential's task is meant), and counts the turn's identical
requests for Q1's key in ``RUNSTEAD_TASK_HOOK_DIR`` (a headless run has no local session
state; ``_claim``). It returns what to print: the decision JSON when the owner allowed or denied,
else None (expired, withdrawn, refused, the service unreachable for 10 s: print nothing,
exit 0, and the headless CLI denies). Its log lines go to ``hook.log`` in the run's hook
folder, never with the credential or the tool input. Imports no Django. Seconds.
"""
import fcntl
import json
import os
from pathlib import Path

from machine.hooks import TASK_ENV, approval, uuid5
from machine.protocol import APPROVAL_INPUT_MAX_BYTES, cut_json, json_digest

CREDENTIAL_ENV = "RUNSTEAD_TASK_CREDENTIAL"
SERVER_ENV = "RUNSTEAD_TASK_SERVER"
HOOK_DIR_ENV = "RUNSTEAD_TASK_HOOK_DIR"
COUNTS_FILE = "approval-counts.json"
KEY_MAX = 255


def request_key(payload: dict, *, hook_dir: str | None, agent: str = "claude") -> str:
    """Q1's key, ``task:`` and the interactive hook's (``approval.approval_key``: agent
    session id, prompt id, tool input digest, and the number of such requests in that
    turn, counted in ``hook_dir``: ``_claim``); a uuid5 of it past the API's 255
    characters."""
    return _key(payload, _claim(hook_dir, _base(payload)) if hook_dir else 1, agent)


def _base(payload: dict) -> str:
    return f"{payload.get('session_id')}:{payload.get('prompt_id')}:{json_digest(_tool_input(payload))}"


def _key(payload: dict, n: int, agent: str = "claude") -> str:
    digest = json_digest(_tool_input(payload))
    key = "task:" + approval.approval_key(agent, payload.get("session_id"), payload.get("prompt_id"), digest, n)
    return key if len(key) <= KEY_MAX else f"task:{uuid5(key)}"


def _tool_input(payload: dict) -> dict:
    tool_input = payload.get("tool_input")
    return tool_input if isinstance(tool_input, dict) else {"value": tool_input}


def _claim(hook_dir: str, base: str) -> int:
    """The count of this request in its turn (same session, prompt and tool input): one
    more than the last, kept in the run's counts file under an exclusive lock."""
    os.makedirs(hook_dir, mode=0o700, exist_ok=True)
    fd = os.open(os.path.join(hook_dir, COUNTS_FILE), os.O_RDWR | os.O_CREAT, 0o600)
    with os.fdopen(fd, "r+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            counts = json.loads(f.read() or "{}")
        except ValueError:
            counts = {}
        n = counts[base] = int(counts.get(base, 0)) + 1
        f.seek(0)
        f.truncate()
        f.write(json.dumps(counts))
    return n


def ask(payload: dict, environ, *, send=None, clock=None, sleep=None) -> str | None:
    """Ask the owner (module docstring); returns the output to print, or None. ``send``,
    ``clock`` and ``sleep`` as for ``approval.Asker`` (tests)."""
    final = decide(payload, environ, send=send, clock=clock, sleep=sleep)
    return approval.decision_output(final, payload) if final is not None else None


def decide(payload: dict, environ, *, agent: str = "claude", send=None, clock=None, sleep=None) -> dict | None:
    """Ask the owner for one request of ``agent`` (a ``SESSION_AGENTS`` name: ``claude``
    for this hook, ``opencode`` for machine/opencode_bridge.py's ``permission.asked``)
    and wait for the answer, as the module docstring says; ``payload`` in Claude Code's
    ``PermissionRequest`` shape (``session_id``, ``prompt_id``, ``tool_name``,
    ``tool_input``, ``cwd``, ``permission_suggestions``). Returns the approval as the API
    shapes it once it is no longer pending (``state``: ``allowed``, ``denied``,
    ``expired``, ...), or None: no credential in ``environ`` (``approvals = "off"``),
    refused, no answer within the wait, the service unreachable for 10 s. Never raises
    for what the network or the service does (a bad ``RUNSTEAD_HOOK_*`` variable:
    ``machine.settings.SettingError``). ``send``, ``clock`` and ``sleep`` as for
    ``approval.Asker`` (tests)."""
    credential, server, task_id = environ.get(CREDENTIAL_ENV), environ.get(SERVER_ENV), environ.get(TASK_ENV)
    if not (credential and server and task_id):
        return None  # approvals = "off": the CLI decides (headless: denied)
    hook_dir = environ.get(HOOK_DIR_ENV) or None
    sent_input, _ = cut_json(_tool_input(payload), APPROVAL_INPUT_MAX_BYTES - 1024)
    cwd = payload.get("cwd") if isinstance(payload.get("cwd"), str) else ""
    tool_name = payload.get("tool_name") if isinstance(payload.get("tool_name"), str) else ""
    body = {
        "key": request_key(payload, hook_dir=hook_dir, agent=agent), "task": task_id, "agent": agent,
        "tool_name": (tool_name or "unknown")[:200], "tool_input": sent_input,
        "cwd": cwd[:1024] if cwd.startswith("/") else "", "suggestions": approval._suggestions(payload),
    }

    def with_credential(method, path, request_body, timeout_s):
        return approval.request(server, credential, method, path, request_body, timeout_s=timeout_s, scheme="Task")

    timing = {k: v for k, v in (("clock", clock), ("sleep", sleep)) if v is not None}
    asker = approval.Asker(Path(hook_dir or os.devnull), server=server, token="", settings=approval.load_settings({}, environ),
                           session_key="", send=send or with_credential, agent=agent, **timing)
    if hook_dir is None:
        asker.log = lambda message: None  # nowhere of its own to write
    try:
        created = asker.create(body)
        if created is None or not isinstance(created.get("id"), str):
            return None
        final = asker.wait(created)
    except approval.Refused as error:  # a final task (401), a bad request: the CLI decides
        asker.log(f"{error}; the CLI decides")
        return None
    return final
