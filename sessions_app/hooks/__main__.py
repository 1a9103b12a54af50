"""``python -m sessions_app.hooks AGENT [PAYLOAD]`` (SPEC I1).

Reads the hook payload (stdin JSON; for Codex ``notify`` the last argument), queues the
writes it implies in the durable outbox together with the session's new local state (one
transaction), starts the sender when none runs, and returns. It prints nothing, always
exits 0, and imports no Django. Bad input (empty, invalid JSON, unknown event, a payload
over ``MAX_PAYLOAD_BYTES``) queues nothing and leaves one line in ``hook.log``.
"""
import json
import os
import sys

MAX_PAYLOAD_BYTES = 4 * 1024 * 1024


def read_payload(argv: list[str]) -> bytes:
    if argv:  # Codex notify: one JSON string as the last argument
        data = argv[-1].encode()
    else:
        data = sys.stdin.buffer.read(MAX_PAYLOAD_BYTES + 1)
    return data


def run(argv: list[str]) -> None:
    from sessions_app.hooks import mapping, sender, store

    state_dir = store.default_state_dir()
    agent = argv[0] if argv else ""
    try:
        if agent not in mapping.AGENTS:
            raise mapping.BadInput(f"unknown agent {agent!r} (one of {', '.join(mapping.AGENTS)})")
        data = read_payload(argv[1:])
        if len(data) > MAX_PAYLOAD_BYTES:
            raise mapping.BadInput(f"payload over {MAX_PAYLOAD_BYTES} bytes")
        if not data.strip():
            raise mapping.BadInput("empty payload")
        try:
            payload = json.loads(data)
        except ValueError as error:
            raise mapping.BadInput(f"invalid JSON: {error}") from None
        event = mapping.identify(agent, payload)
        hostname = os.uname().nodename
        with store.Outbox(state_dir) as outbox:
            with outbox.transaction():
                state = outbox.session_state(event.key)
                writes = mapping.handle(event, payload, state, hostname=hostname)
                if writes:
                    outbox.append(writes)
                    outbox.save_session_state(event.key, state)
        if writes:
            sender.ensure_sender(state_dir)
    except mapping.BadInput as error:
        store.log_line(state_dir, store.HOOK_LOG, f"{agent or '-'}: ignored: {error}")
    except Exception as error:  # noqa: BLE001 - a hook never hurts its host (STYLE 12)
        store.log_line(state_dir, store.HOOK_LOG, f"{agent or '-'}: error: {error!r}")


def main() -> None:
    try:
        run(sys.argv[1:])
    finally:
        os._exit(0)  # nothing the interpreter does at exit can change the status


if __name__ == "__main__":
    main()
