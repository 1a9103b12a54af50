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

The machine's worker also sweeps (``orphans``): a ``take`` file untouched for
``STALE_TAKE_S`` in a session that no live wrapper runs was taken by a wrapper (or a Stop
hook) killed before it finished, and no new wrapper of that session came to report it:
it becomes ``lost`` (reported ``undelivered``; the rename again decides, so a wrapper
starting at that moment and the worker never both report it). Leftover folders of dead
wrappers are removed, and ``prune`` deletes finished files (``done``, ``lost``, ``gone``,
taken interrupts) older than the worker's record retention, and emptied session folders.
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
        if name.startswith(INTERRUPT + "-") and name.endswith(".json"):  # not a record's tmp file
            folder = session_dir(state_dir, session_id)
            try:
                os.rename(os.path.join(folder, name), os.path.join(folder, INTERRUPT_TAKEN + name[len(INTERRUPT):]))
            except FileNotFoundError:
                continue
            return True
    return False


STALE_TAKE_S = 30.0  # far longer than a wrapper's paste (0.15 s) or a Stop hook's claim (2 s)
FINISHED = (DONE, LOST, GONE, INTERRUPT_TAKEN)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def live_terminals(state_dir: str) -> set[str]:
    """The sessions a live terminal wrapper runs (``terminals/<pid>/state.json``); the
    folders of dead wrappers (killed before their clean-up) are removed."""
    import json
    import shutil

    root, live = os.path.join(state_dir, "terminals"), set()
    try:
        pids = os.listdir(root)
    except OSError:
        return live
    for pid in pids:
        folder = os.path.join(root, pid)
        if not pid.isdigit() or not _alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
            continue
        try:
            with open(os.path.join(folder, "state.json"), "rb") as handle:
                session_id = json.loads(handle.read()).get("session_id")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(session_id, str):
            live.add(session_id)
    return live


def orphans(state_dir: str, *, now: float, stale_s: float = STALE_TAKE_S) -> list[dict]:
    """Mark ``lost`` every message taken over ``stale_s`` ago (by the file's ctime, which
    the take's rename set) in a session no live wrapper runs; returns their payloads,
    each to be reported ``undelivered`` once."""
    live, found = live_terminals(state_dir), []
    try:
        sessions = os.listdir(inbox_root(state_dir))
    except OSError:
        return found
    for session_id in sessions:
        if session_id in live:
            continue  # its wrapper sweeps its own (Wrapper.sweep)
        for name in in_state(state_dir, session_id, TAKE):
            path = os.path.join(session_dir(state_dir, session_id), name)
            try:
                if now - os.stat(path).st_ctime < stale_s:
                    continue
                payload = payload_of(state_dir, session_id, name)
            except (OSError, ValueError):
                continue
            if move(state_dir, session_id, name, LOST):
                found.append(payload)
    return found


def prune(state_dir: str, *, before: float) -> int:
    """Delete finished files (``done``, ``lost``, ``gone``, taken interrupts) last changed
    before ``before`` (epoch seconds), then emptied session folders; how many files.
    Waiting and taken messages stay. A message is delivered again only within the
    service's visibility window, far shorter than the retention, so W3 still holds."""
    count = 0
    try:
        sessions = os.listdir(inbox_root(state_dir))
    except OSError:
        return 0
    for session_id in sessions:
        folder = session_dir(state_dir, session_id)
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in names:
            if name.split("-", 1)[0] not in FINISHED:
                continue
            try:
                if os.stat(os.path.join(folder, name)).st_ctime < before:
                    os.unlink(os.path.join(folder, name))
                    count += 1
            except OSError:
                continue
        try:
            os.rmdir(folder)  # only when empty
        except OSError:
            pass
    return count
