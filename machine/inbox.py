"""The local inbox of terminal sessions (SPEC T2-T5): where the worker records an owner's
message for a session on this machine before it acknowledges it (W2), and where the
terminal wrapper (T3) or the session's Stop hook (T4) takes it, at most once.

One folder per session, ``<hook state dir>/inbox/<session id>/`` (mode 0700), one small
JSON file per message whose name says its state; every change of state is one
``os.rename``, which is atomic, so of two takers exactly one wins, and a kill -9 at any
point leaves the message in exactly one state:

- ``wait-<seq>-<message id>.json``: recorded by the worker (fsynced: ``machine.files``);
- ``take-...``: a taker renamed it to itself; it may or may not have reached the agent;
  one found by a new taker after a crash is never handed on again (``undelivered``);
- ``done-...``: handed to the agent (typed, or printed by the Stop hook);
- ``lost-...``: will never be handed on (reported ``undelivered``);
- ``gone-...``: withdrawn, or claimed elsewhere (the service said 409).

The worker records a message only when no file of that message id exists in any state,
so a message delivered again (an ack that was lost) is recognised and not handed twice
(W3). An interrupt (T5) is ``intr-<interrupt id>.json``, taken by renaming it to
``ints-...``. Imports only ``os`` and ``machine.files`` (the Stop hook reads it, I1).
"""
import os

from machine.files import write_atomic

WAIT, TAKE, DONE, LOST, GONE = "wait", "take", "done", "lost", "gone"
STATES = (WAIT, TAKE, DONE, LOST, GONE)
INTERRUPT, INTERRUPT_TAKEN = "intr", "ints"


def hook_state_dir() -> str:
    """The hook state directory the hooks use (``machine.hooks.store.default_state_dir``):
    ``RUNSTEAD_HOOK_DIR`` or ``~/.runstead/hooks``; the inbox lives inside it."""
    return os.environ.get("RUNSTEAD_HOOK_DIR") or os.path.join(os.path.expanduser("~"), ".runstead", "hooks")


def inbox_root(state_dir: str) -> str:
    return os.path.join(state_dir, "inbox")


def session_dir(state_dir: str, session_id: str) -> str:
    return os.path.join(inbox_root(state_dir), session_id)


def _name(state: str, seq: int, message_id: str) -> str:
    return f"{state}-{seq:09d}-{message_id}.json"


def _ensure(folder: str) -> str:
    """``folder`` and its two parents (session, inbox, hook state dir) with mode 0700 (W5)."""
    parents = [os.path.dirname(os.path.dirname(folder)), os.path.dirname(folder), folder]
    for path in parents:
        os.makedirs(path, mode=0o700, exist_ok=True)
        if os.stat(path).st_mode & 0o077:
            os.chmod(path, 0o700)
    return folder


def record(state_dir: str, payload: dict) -> bool:
    """The worker's record of a ``session_message`` payload (W2): True when it was new and
    is now ``wait``, False when the message id is known in any state (W3)."""
    folder = _ensure(session_dir(state_dir, payload["session_id"]))
    message_id = payload["message_id"]
    if any(name.endswith(f"-{message_id}.json") for name in os.listdir(folder)):
        return False
    import json

    body = json.dumps({k: payload[k] for k in ("session_id", "message_id", "seq", "text", "channel")})
    write_atomic(os.path.join(folder, _name(WAIT, int(payload["seq"]), message_id)), body)
    return True


def record_interrupt(state_dir: str, session_id: str, interrupt_id: str) -> bool:
    folder = _ensure(session_dir(state_dir, session_id))
    names = os.listdir(folder)
    if f"{INTERRUPT}-{interrupt_id}.json" in names or f"{INTERRUPT_TAKEN}-{interrupt_id}.json" in names:
        return False
    write_atomic(os.path.join(folder, f"{INTERRUPT}-{interrupt_id}.json"), "{}")
    return True


def waiting(state_dir: str, session_id: str) -> list[str]:
    """The names of the session's ``wait`` messages, oldest (lowest seq) first; [] when
    there is no inbox (the common Stop: one ``listdir``, no network, I1)."""
    try:
        names = os.listdir(session_dir(state_dir, session_id))
    except OSError:
        return []
    return sorted(n for n in names if n.startswith(WAIT + "-") and n.endswith(".json"))


def in_state(state_dir: str, session_id: str, state: str) -> list[str]:
    try:
        names = os.listdir(session_dir(state_dir, session_id))
    except OSError:
        return []
    return sorted(n for n in names if n.startswith(state + "-") and n.endswith(".json"))


def move(state_dir: str, session_id: str, name: str, to: str) -> str | None:
    """Rename message file ``name`` to state ``to``; the new name, or None when another
    taker moved it first (the rename is the at-most-once step)."""
    folder = session_dir(state_dir, session_id)
    new = to + name[name.index("-"):]
    try:
        os.rename(os.path.join(folder, name), os.path.join(folder, new))
    except FileNotFoundError:
        return None
    return new


def take(state_dir: str, session_id: str) -> tuple[str, dict] | None:
    """Take the session's oldest waiting message: ``(its take- name, its payload)``, or
    None when none waits (or another taker won every one)."""
    for name in waiting(state_dir, session_id):
        taken = move(state_dir, session_id, name, TAKE)
        if taken is None:
            continue
        import json

        with open(os.path.join(session_dir(state_dir, session_id), taken), "rb") as handle:
            return taken, json.loads(handle.read())
    return None


def payload_of(state_dir: str, session_id: str, name: str) -> dict:
    import json

    with open(os.path.join(session_dir(state_dir, session_id), name), "rb") as handle:
        return json.loads(handle.read())


def take_interrupt(state_dir: str, session_id: str) -> bool:
    """Take one pending interrupt of the session (T5); True when this caller took one."""
    try:
        names = sorted(os.listdir(session_dir(state_dir, session_id)))
    except OSError:
        return False
    for name in names:
        if name.startswith(INTERRUPT + "-"):
            folder = session_dir(state_dir, session_id)
            try:
                os.rename(os.path.join(folder, name), os.path.join(folder, INTERRUPT_TAKEN + name[len(INTERRUPT):]))
            except FileNotFoundError:
                continue
            return True
    return False
