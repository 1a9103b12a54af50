"""The hook: ``python -m machine.hooks AGENT [--task] [PAYLOAD]`` (SPEC I1), which
``install_hooks`` writes as ``python -S -P <checkout>/machine/hooks/__main__.py``.

Reads the hook payload (stdin JSON; for Codex ``notify`` the last argument), queues the
writes it implies in the durable outbox together with the session's new local state (one
transaction), starts the sender when none runs, and returns. A tool hook with no long
turn to continue (I7) only reads the session's local state (its snapshot file, else
the outbox read-only; no lock) and returns: no outbox write, no network, nothing started. It prints nothing, always
exits 0, and imports no Django. The one exception is ``PermissionRequest`` (Claude Code,
Codex; Q3): after queueing what it implies like any hook, it asks the service for the owner's
answer and waits for it (``machine.hooks.approval``), printing the decision JSON
when the owner allowed or denied, and nothing otherwise. Bad input (empty, invalid JSON, unknown event, a payload
over ``MAX_PAYLOAD_BYTES``) queues nothing and leaves one line in ``hook.log``.

Inside a RunStead task (Q5), Claude Code's ``PermissionRequest`` asks the owner through
the task's credential and waits (``task_approval``), printing the decision, from the
entry the worker added for the run (``--task``) only.
"""
import os
import sys
import time

MAX_PAYLOAD_BYTES = 4 * 1024 * 1024


def read_payload(argv: list[str]) -> bytes:
    if argv:  # Codex notify: one JSON string as the last argument
        data = argv[-1].encode()
    else:
        data = sys.stdin.buffer.read(MAX_PAYLOAD_BYTES + 1)
    return data


def run(argv: list[str]) -> None:
    from machine.hooks import DEFAULT_MARKER_CLASS_S, TASK_FLAG, in_task, json_loads, mapping, store

    state_dir = store.default_state_dir()
    agent = argv[0] if argv else ""
    task_entry = argv[1:2] == [TASK_FLAG]  # Q5: the entry a worker added for one run
    if task_entry:
        argv = argv[:1] + argv[2:]
    try:
        if agent not in mapping.AGENTS:
            raise mapping.BadInput(f"unknown agent {agent!r} (one of {', '.join(mapping.AGENTS)})")
        data = read_payload(argv[1:])
        if len(data) > MAX_PAYLOAD_BYTES:
            raise mapping.BadInput(f"payload over {MAX_PAYLOAD_BYTES} bytes")
        if not data.strip():
            raise mapping.BadInput("empty payload")
        try:
            payload = json_loads(data)
        except ValueError as error:
            raise mapping.BadInput(f"invalid JSON: {error}") from None
        if agent == "claude" and isinstance(payload, dict) and payload.get("hook_event_name") == "PermissionRequest" \
                and in_task(os.environ):  # Q5: a headless task asks through its own entry only
            from machine.hooks import task_approval

            return answer_permission(task_approval.ask(payload, os.environ) if task_entry else None)
        event = mapping.identify(agent, payload)
        if mapping.codex_title_thread(event, payload):
            return
        if agent == "claude" and event.name == "Stop" and not os.environ.get(TERMINAL_ENV):
            from machine.hooks import deliver

            block = deliver.stop_delivery(str(state_dir), session_id=mapping.session_uuid(agent, event.agent_session_id),
                                          payload=payload,
                                          config=store.read_config(state_dir))
            if block:
                os.write(1, block.encode() + b"\n")
                return  # T4: the turn goes on with the message; its next Stop does the rest
        now = time.time()
        class_s = DEFAULT_MARKER_CLASS_S
        if mapping.is_activity(event, payload):
            class_s = store.marker_class_s(state_dir)
            peeked = store.peek_session_state(state_dir, event.key)
            if mapping.nothing_due(event, payload, peeked, now=now, class_s=class_s):
                return  # I7: the common case of a tool hook, decided from local state alone
        hostname = os.uname().nodename
        asking = event.name == "PermissionRequest"
        with store.Outbox(state_dir) as outbox:
            with outbox.transaction():
                state = outbox.session_state(event.key)
                writes = mapping.handle(event, payload, state, hostname=hostname, now=now, class_s=class_s,
                                        binding=binding(store.read_config(state_dir), os.environ, agent))
                if asking:
                    from machine.hooks import approval

                    ask = approval.prepare(agent=agent, agent_session_id=event.agent_session_id,
                                           session_id=mapping.session_uuid(agent, event.agent_session_id),
                                           payload=payload, state=state)
                if writes:
                    outbox.append(writes)
                if writes or asking:
                    outbox.save_session_state(event.key, state)
                if os.environ.get(TERMINAL_ENV):  # under the outbox's lock: hooks running at once write in turn
                    terminal_state(os.environ[TERMINAL_ENV],
                                   session_id=mapping.session_uuid(agent, event.agent_session_id),
                                   busy=bool(state.get("turn")), agent_session=event.agent_session_id)
        if writes:
            from machine.hooks import launch

            launch.ensure_sender(state_dir)
        if asking:
            output = approval.ask_and_wait(state_dir, session_key=event.key, body=ask, payload=payload, agent=agent)
            if output:
                os.write(1, output.encode() + b"\n")
    except mapping.BadInput as error:
        store.log_line(state_dir, store.HOOK_LOG, f"{agent or '-'}: ignored: {error}")
    except Exception as error:  # noqa: BLE001 - a hook never hurts its host (STYLE 12)
        store.log_line(state_dir, store.HOOK_LOG, f"{agent or '-'}: error: {error!r}")


# T3: set by the terminal wrapper in its agent's environment: the wrapper's own folder,
# where the hooks say which session runs in it and whether a turn is open.
TERMINAL_ENV = "RUNSTEAD_TERMINAL"


def binding(config: dict, environ, agent: str) -> dict:
    """T1: the session's machine (``install_hooks --machine``) and channel: ``terminal``
    under the wrapper, ``hook`` for Claude Code (its Stop hook, T4), else ``none``; {}
    when the hooks were not installed on a paired machine."""
    machine = config.get("machine")
    if not isinstance(machine, str) or not machine:
        return {}
    channel = "terminal" if environ.get(TERMINAL_ENV) else "hook" if agent == "claude" else "none"
    return {"machine": machine, "channel": channel}


def terminal_state(folder: str, *, session_id: str, busy: bool, agent_session: str = "") -> None:
    """T3: tell the wrapper which session it runs (RunStead's id and the agent's own) and
    whether a turn is open (one small file, replaced at once; no fsync: the next hook
    writes it again)."""
    from machine.files import write_atomic
    from machine.hooks import json_dumps

    try:
        write_atomic(os.path.join(folder, "state.json"),
                     json_dumps({"session_id": session_id, "busy": busy, "agent_session": agent_session}), sync=False)
    except OSError:
        pass


def answer_permission(output: str | None) -> None:
    """Print a ``PermissionRequest`` decision (Q3), or nothing for None."""
    if output:
        os.write(1, output.encode() + b"\n")


def main() -> None:
    try:
        run(sys.argv[1:])
    finally:
        os._exit(0)  # nothing the interpreter does at exit can change the status
