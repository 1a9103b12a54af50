"""opencode's live conversation as a stdio agent (SPEC C1, C4, C11): a small bridge between
the launcher (``launcher.py``, which speaks to every live agent over stdin/stdout) and
``opencode serve`` (HTTP on a loopback port), docs/opencode-server.md.

Usage: ``python -I opencode_bridge.py OPENCODE_BINARY``

It starts ``OPENCODE_BINARY serve --hostname 127.0.0.1 --port 0 --no-mdns`` as its child with
a fresh random password in ``OPENCODE_SERVER_PASSWORD`` (HTTP basic auth, user
``opencode``): the server is never started without one (opencode's unauthenticated server
was CVE-2026-22812) nor on another address (an explicit ``--hostname`` wins over any
``server.hostname`` of opencode's config; the address it prints is checked too). The
password lives only in this process and the server's environment; it is never printed.

The server leads a process group of its own (opencode signals process groups when it ends
its commands; one run of the real test lost the launcher, the bridge and the server to one
SIGKILL with no record, cause not found: in its own group, whatever it signals stays
there) and dies with the bridge (``PR_SET_PDEATHSIG``: SIGKILL when the bridge ends, even
by SIGKILL). SIGTERM to the bridge (the worker's stop, L4, J7; the launcher's lease stop,
L8) stops the server's group (SIGTERM, then SIGKILL after ``STOP_GRACE_S``) and exits 143.

Then it follows the server's event stream (``GET /event``, server-sent events), creates one
session (``POST /session``) and prints ``{"type": "bridge.ready", "sessionID"}``; after that:

- stdin, one JSON object a line: ``{"prompt": TEXT}`` -> ``POST
  /session/{id}/prompt_async`` ``{"parts": [{"type": "text", "text": TEXT}]}``;
  ``{"abort": true}`` -> ``POST /session/{id}/abort`` (the session stays). A request the
  server refuses prints ``{"type": "bridge.error", "request": "prompt"|"abort"|"permission",
  "status", "body"}`` (a refused prompt makes no turn). EOF: the server is stopped (SIGTERM,
  then SIGKILL after ``STOP_GRACE_S``) and the bridge exits with its status;
- an abort that arrives after a prompt whose turn has not started yet (no ``session.status``
  busy or retry, and no assistant ``message.updated``, since the prompt was written: the
  first turn of a fresh home loads opencode's plugins for 10-35 s first, and an abort then
  answers ``200`` and does nothing) is held (``AbortGate``) and sent as soon as the turn
  starts, printed as ``{"type": "bridge.abort", "properties": {"sessionID", "held_s"}}``;
  a turn that ends without starting (a refused prompt) drops it; an abort with no prompt
  waiting is sent at once (nothing open: the server answers ``200`` and nothing happens);
- every ``permission.asked`` of the session is answered (``POST
  /permission/{id}/reply {"reply": "once"|"always"|"reject", "message"?}``): at once with
  ``reject`` unless the environment holds the task's approval credential (SPEC Q5,
  ``machine/worker/approvals.py``: ``RUNSTEAD_TASK_CREDENTIAL``, ``RUNSTEAD_TASK_SERVER``,
  ``RUNSTEAD_TASK_ID``); with it, the owner is asked through the service exactly as the
  task's Claude Code hook asks (``machine.hooks.task_approval.decide``) and the answer is
  the decision (allowed -> ``once``, or ``always`` for scope ``session``; denied, expired,
  withdrawn, unreachable -> ``reject``, with the owner's message when denied). The
  credential stays in this process: it is left out of the server's environment (the
  agent's commands never see it) and never printed;
- stdout: each event of the session as one JSON line ``{"type", "properties"}`` as the
  server sent it, but for ``message.part.delta`` and ``session.diff`` (the part's
  final ``message.part.updated`` carries the text; the diffs can be large); events of no
  session are left out (plugin and catalog chatter, heartbeats); when the stream drops
  and comes back, the session's messages are printed again as events (``resync``: a turn
  that ended meanwhile is not lost, so the session never stays busy here);
- the server ending ends the bridge with its status.

Standard library only, run by path with ``python -I`` (as the launcher).
"""
import base64
import ctypes
import http.client
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time

HOST = "127.0.0.1"
USERNAME = "opencode"
START_TIMEOUT_S = 120.0  # the server's "listening on" line (about 4-6 s on 2 shared cores)
STOP_GRACE_S = 5.0
LEFT_OUT = ("message.part.delta", "session.diff")
LISTENING = re.compile(r"listening on http://([^/:\s]+):(\d+)")
PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Q5: the names machine.worker.approvals.asking_env sets (machine.hooks.task_approval reads them).
CREDENTIAL_ENV = "RUNSTEAD_TASK_CREDENTIAL"
SERVER_ENV = "RUNSTEAD_TASK_SERVER"
TASK_ENV = "RUNSTEAD_TASK_ID"

_out_lock = threading.Lock()


def emit(event: dict) -> None:
    """One JSON line on stdout, whole (one write under a lock: two threads print)."""
    data = (json.dumps(event, separators=(",", ":")) + "\n").encode()
    with _out_lock:
        os.write(1, data)


def serve_argv(binary: str) -> list[str]:
    """The server's argv: loopback only, a port the kernel picks, no mDNS."""
    return [binary, "serve", "--hostname", HOST, "--port", "0", "--no-mdns"]


def serve_env(environ: dict, password: str) -> dict:
    """The server's environment: ``environ`` with the password and the user name set (a
    ``OPENCODE_SERVER_USERNAME`` or password inherited is replaced) and without the task's
    approval credential (``CREDENTIAL_ENV``: only the bridge asks with it, Q5, W5)."""
    kept = {key: value for key, value in environ.items() if key != CREDENTIAL_ENV}
    return {**kept, "OPENCODE_SERVER_PASSWORD": password, "OPENCODE_SERVER_USERNAME": USERNAME}


class Server:
    """The running ``opencode serve`` and how to call it."""

    def __init__(self, binary: str):
        self.stopping = False  # the bridge stops it (stdin ended)
        self.observers: list = []  # each called with every event printed (after it is printed)
        self.password = secrets.token_urlsafe(32)
        self.auth = "Basic " + base64.b64encode(f"{USERNAME}:{self.password}".encode()).decode()
        self.proc = subprocess.Popen(serve_argv(binary), env=serve_env(dict(os.environ), self.password),
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=None,
                                     process_group=0, preexec_fn=_die_with_parent)
        self.port = self._port()
        threading.Thread(target=self._drain, daemon=True).start()

    def _port(self) -> int:
        """The port of the server's "listening on" line; SystemExit when it names another
        address, or the server ends (or is ended, ``START_TIMEOUT_S`` after its start)
        before it says it listens."""
        watchdog = threading.Timer(START_TIMEOUT_S, self.stop)
        watchdog.start()
        try:
            for line in self.proc.stdout:
                text = line.decode("utf-8", "replace").rstrip()
                sys.stderr.write(f"opencode serve: {text}\n")
                if (match := LISTENING.search(text)) is not None:
                    if match.group(1) != HOST:
                        self.stop()
                        raise SystemExit(f"runstead opencode bridge: the server listens on {match.group(1)}, "
                                         f"not {HOST}")
                    return int(match.group(2))
        finally:
            watchdog.cancel()
        raise SystemExit(f"runstead opencode bridge: the server ended before it listened (exit {self.stop()})")

    def _drain(self) -> None:
        for line in self.proc.stdout:
            sys.stderr.write(f"opencode serve: {line.decode('utf-8', 'replace').rstrip()}\n")

    def request(self, method: str, path: str, body=None, timeout: float = 30.0) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(HOST, self.port, timeout=timeout)
        try:
            conn.request(method, path, json.dumps(body) if body is not None else None,
                         {"Authorization": self.auth, "Content-Type": "application/json"})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def events(self, session: dict, connected: threading.Event) -> None:
        """Follow ``/event`` until the server ends, printing the session's events (module
        docstring); ``session["id"]`` is set once the session exists (events before it:
        its own ``session.created`` is kept, others of no session are not)."""
        while self.proc.poll() is None:
            conn = http.client.HTTPConnection(HOST, self.port)
            try:
                conn.request("GET", "/event", headers={"Authorization": self.auth, "Accept": "text/event-stream"})
                resp = conn.getresponse()
                if resp.status != 200:
                    raise OSError(f"/event answered {resp.status}")
                if connected.is_set() and session.get("id"):
                    self.resync(session["id"])  # what the stream missed while it was down
                connected.set()
                for raw in resp.fp:
                    line = raw.decode("utf-8", "replace").rstrip("\r\n")
                    if not line.startswith("data:"):
                        continue
                    try:
                        event = json.loads(line[5:])
                    except ValueError:
                        continue
                    if isinstance(event, dict) and keep(event, session.get("id")):
                        self.deliver(event)
            except (OSError, http.client.HTTPException) as exc:
                sys.stderr.write(f"runstead opencode bridge: event stream: {exc}\n")
            finally:
                conn.close()
            time.sleep(0.2)

    def resync(self, session_id: str) -> None:
        """After the event stream dropped and came back: the session's messages as the
        server lists them (``GET /session/{id}/message``), printed as the events that
        would have said the same (each part's ``message.part.updated``, then its message's
        ``message.updated``), then its status (``GET /session/status``, absent: idle) as a
        ``session.status``, so a turn that ended meanwhile still ends here (the adapter
        and the parser count each turn end and part once); and each permission of the
        session still pending (``GET /permission``) as its ``permission.asked``."""
        try:
            status, body = self.request("GET", f"/session/{session_id}/message")
            listed = json.loads(body) if status == 200 else []
        except (OSError, http.client.HTTPException, ValueError) as exc:
            sys.stderr.write(f"runstead opencode bridge: resync: {exc}\n")
            return
        for message in listed if isinstance(listed, list) else []:
            if not isinstance(message, dict) or not isinstance(message.get("info"), dict):
                continue
            for part in message.get("parts") or []:
                self.deliver({"type": "message.part.updated", "properties": {"sessionID": session_id, "part": part}})
            self.deliver({"type": "message.updated", "properties": {"sessionID": session_id, "info": message["info"]}})
        try:  # the session's status now (absent: idle), so a loop that stopped meanwhile ends here too
            status, body = self.request("GET", "/session/status")
            statuses = json.loads(body) if status == 200 else None
        except (OSError, http.client.HTTPException, ValueError) as exc:
            sys.stderr.write(f"runstead opencode bridge: resync: {exc}\n")
            statuses = None
        if isinstance(statuses, dict):
            now = statuses.get(session_id) if isinstance(statuses.get(session_id), dict) else {"type": "idle"}
            self.deliver({"type": "session.status", "properties": {"sessionID": session_id, "status": now}})
        try:  # a permission asked while the stream was down is still waiting for its answer
            status, body = self.request("GET", "/permission")
            pending = json.loads(body) if status == 200 else []
        except (OSError, http.client.HTTPException, ValueError) as exc:
            sys.stderr.write(f"runstead opencode bridge: resync: {exc}\n")
            return
        for asked in pending if isinstance(pending, list) else []:
            if isinstance(asked, dict) and asked.get("sessionID") == session_id:
                self.deliver({"type": "permission.asked", "properties": asked})

    def deliver(self, event: dict) -> None:
        """Print one event of the session, then show it to each observer (``AbortGate``,
        ``Permissions``)."""
        emit(event)
        for observe in self.observers:
            observe(event)

    def stop(self) -> int:
        """The server's group: SIGTERM, then SIGKILL after ``STOP_GRACE_S``; its status."""
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        self._signal(signal.SIGKILL)  # what is left of its group
        return self.proc.wait()

    def _signal(self, sig) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except OSError:
            pass


class AbortGate:
    """C4: an abort is never dropped because the turn it is meant for has not started yet.

    ``prompted()`` when a prompt is about to be written; ``abort()`` when an abort is asked:
    True to send it now, False when it is held (a prompt was written and its turn has not
    started); ``see(event)`` for each event of the session (and each ``bridge.error``):
    the seconds the held abort waited when it is due now (send it), else None. A turn has started at the first ``session.status`` busy or retry, or assistant
    ``message.updated``, after its prompt (opencode sets busy when its loop for the
    prompt begins, and an abort from then on ends the turn; before it, on a fresh home's
    first turn, the server answers ``200`` and nothing happens: docs/opencode-server.md).
    A prompt written while the session is busy joins the running loop: its turn has
    started. A ``bridge.error`` of a prompt (refused: no turn) drops a held abort.
    Thread-safe (stdin and the event stream are two threads)."""

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self._lock = threading.Lock()
        self.busy = False  # the session's last status was busy or retry
        self.waiting = False  # a prompt was written and its turn has not started
        self.held: float | None = None  # when the abort being held was asked (clock seconds)

    def prompted(self) -> None:
        with self._lock:
            self.waiting = not self.busy

    def abort(self) -> bool:
        with self._lock:
            if self.waiting:
                if self.held is None:
                    self.held = self.clock()
                return False
            return True

    def see(self, event: dict) -> float | None:
        """The seconds a held abort waited when it is due now (send it), else None."""
        kind = event.get("type")
        props = event.get("properties") if isinstance(event.get("properties"), dict) else {}
        started = False
        with self._lock:
            if kind == "session.status":
                status = props.get("status") if isinstance(props.get("status"), dict) else {}
                self.busy = status.get("type") in ("busy", "retry")
                started = self.busy
            elif kind == "message.updated":
                info = props.get("info") if isinstance(props.get("info"), dict) else {}
                started = info.get("role") == "assistant"
            elif kind == "bridge.error" and props.get("request") == "prompt":
                self.waiting, self.held = False, None
                return None
            if not (started and self.waiting):
                return None
            self.waiting = False
            held, self.held = self.held, None
        return None if held is None else max(0.0, self.clock() - held)


def permission_reply(approval: dict | None) -> dict:
    """Q5: the body of ``POST /permission/{id}/reply`` for the owner's answer: ``approval``
    as the service's API shapes it (``state``, ``scope``, ``message``), or None (no
    answer: expired, withdrawn, the service unreachable, no credential). Allowed ->
    ``{"reply": "once"}`` (scope ``session``: ``"always"``: opencode allows what the
    request's ``always`` patterns cover for the rest of the session); anything else ->
    ``{"reply": "reject"}``, with the owner's message when denied with one (opencode
    gives it to the model)."""
    state = approval.get("state") if isinstance(approval, dict) else None
    if state == "allowed":
        return {"reply": "always" if approval.get("scope") == "session" else "once"}
    body = {"reply": "reject"}
    if state == "denied" and isinstance(approval.get("message"), str) and approval["message"]:
        body["message"] = approval["message"]
    return body


def ask_payload(asked: dict, cwd: str) -> dict:
    """What ``machine.hooks.task_approval.decide`` takes for one ``permission.asked``
    (``properties``: ``id``, ``sessionID``, ``permission``, ``patterns``, ``metadata``,
    ``always``, ``tool {messageID, callID}``): the tool is the permission's name
    (``bash``), its input the patterns and metadata (for bash, the command), the
    session's id and the asking assistant message's id (Q1's key: a second identical
    request in the same message counts 2)."""
    tool = asked.get("tool") if isinstance(asked.get("tool"), dict) else {}
    return {"session_id": asked.get("sessionID"), "prompt_id": tool.get("messageID") or asked.get("id"),
            "tool_name": asked.get("permission") if isinstance(asked.get("permission"), str) else "",
            "tool_input": {"patterns": asked.get("patterns"), "metadata": asked.get("metadata")}, "cwd": cwd}


class Permissions:
    """Answers each ``permission.asked`` of the session once (module docstring), each in
    a thread of its own (an owner's answer can take minutes; the events go on)."""

    def __init__(self, server: "Server", session: dict, environ, cwd: str):
        self.server, self.session, self.environ, self.cwd = server, session, environ, cwd
        self._lock = threading.Lock()
        self.seen: set[str] = set()

    def asks(self) -> bool:
        """Whether the owner is asked (the task's credential, server and id are set)."""
        return all(self.environ.get(name) for name in (CREDENTIAL_ENV, SERVER_ENV, TASK_ENV))

    def see(self, event: dict) -> None:
        props = event.get("properties") if isinstance(event.get("properties"), dict) else {}
        if event.get("type") != "permission.asked" or props.get("sessionID") != self.session.get("id") \
                or not isinstance(props.get("id"), str):
            return
        with self._lock:
            if props["id"] in self.seen:
                return
            self.seen.add(props["id"])
        threading.Thread(target=self.answer, args=(props,), daemon=True).start()

    def answer(self, asked: dict) -> None:
        """Decide (ask the owner, or reject) and reply to the server; a refused reply
        prints ``bridge.error`` (``request: "permission"``)."""
        approval = None
        if self.asks():
            try:
                if PROJECT_ROOT not in sys.path:
                    sys.path.append(PROJECT_ROOT)  # -I: this checkout's hooks, standard library only
                from machine.hooks import task_approval

                approval = task_approval.decide(ask_payload(asked, self.cwd), self.environ, agent="opencode")
            except Exception as exc:  # noqa: BLE001 - never a hung turn: the request is rejected
                sys.stderr.write(f"runstead opencode bridge: asking the owner failed ({type(exc).__name__}); "
                                 "rejected\n")
        body = permission_reply(approval)
        try:
            status, answer = self.server.request("POST", f"/permission/{asked['id']}/reply", body)
        except (OSError, http.client.HTTPException) as exc:
            status, answer = 0, str(exc).encode()
        if status >= 300 or status == 0:
            emit({"type": "bridge.error", "properties": {"sessionID": self.session.get("id"),
                                                         "request": "permission", "status": status,
                                                         "body": answer[:500].decode("utf-8", "replace")}})


def _die_with_parent() -> None:
    """In the server's child before exec: SIGKILL when the bridge ends (Linux prctl)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def keep(event: dict, session_id: str | None) -> bool:
    """Whether an event of the server goes to stdout (module docstring)."""
    if event.get("type") in LEFT_OUT:
        return False
    props = event.get("properties") if isinstance(event.get("properties"), dict) else {}
    sid = props.get("sessionID")
    return isinstance(sid, str) and (session_id is None or sid == session_id)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        sys.stderr.write("usage: opencode_bridge.py OPENCODE_BINARY\n")
        return 2
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    started: list[Server] = []

    def on_term(*_):
        for server in started:  # none yet: the server dies with the bridge (parent-death signal)
            server.stopping = True
            server.stop()
        os._exit(128 + signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_term)
    server = Server(argv[0])
    started.append(server)
    session: dict = {}
    gate = AbortGate()
    server.observers.append(lambda event: _send_held_abort(server, session, gate.see(event)))
    server.observers.append(Permissions(server, session, os.environ, os.getcwd()).see)
    connected = threading.Event()
    threading.Thread(target=server.events, args=(session, connected), daemon=True).start()
    connected.wait(START_TIMEOUT_S)
    status, body = server.request("POST", "/session", {})
    if status != 200:
        sys.stderr.write(f"runstead opencode bridge: POST /session answered {status}: {body[:500]!r}\n")
        return server.stop() or 1
    session["id"] = json.loads(body)["id"]
    emit({"type": "bridge.ready", "properties": {"sessionID": session["id"]}})
    threading.Thread(target=_exit_with_server, args=(server,), daemon=True).start()
    for raw in sys.stdin.buffer:
        try:
            item = json.loads(raw)
        except ValueError:
            continue
        if not isinstance(item, dict):
            continue
        if isinstance(item.get("prompt"), str):
            what, path = "prompt", f"/session/{session['id']}/prompt_async"
            body = {"parts": [{"type": "text", "text": item["prompt"]}]}
            gate.prompted()
        elif item.get("abort") is True:
            if not gate.abort():
                continue  # held until its turn starts (AbortGate)
            what, path, body = "abort", f"/session/{session['id']}/abort", None
        else:
            continue
        try:
            status, answer = server.request("POST", path, body)
        except (OSError, http.client.HTTPException) as exc:
            status, answer = 0, str(exc).encode()
        if status >= 300 or status == 0:
            error = {"type": "bridge.error", "properties": {"sessionID": session["id"], "request": what,
                                                            "status": status,
                                                            "body": answer[:500].decode("utf-8", "replace")}}
            emit(error)
            gate.see(error)  # a refused prompt makes no turn: an abort held for it is dropped
    server.stopping = True
    server.stop()
    return 0  # the end asked for (C5): the server stopped as it should


def _send_held_abort(server: Server, session: dict, held_s: float | None) -> None:
    """An abort ``AbortGate`` held, now that its turn started: sent (in a thread of its
    own: the event stream goes on) and printed as ``bridge.abort``."""
    if held_s is None:
        return

    def send():
        try:
            status, answer = server.request("POST", f"/session/{session['id']}/abort")
        except (OSError, http.client.HTTPException) as exc:
            status, answer = 0, str(exc).encode()
        if status >= 300 or status == 0:
            emit({"type": "bridge.error", "properties": {"sessionID": session["id"], "request": "abort",
                                                         "status": status,
                                                         "body": answer[:500].decode("utf-8", "replace")}})
        else:
            emit({"type": "bridge.abort", "properties": {"sessionID": session["id"], "held_s": round(held_s, 3)}})

    threading.Thread(target=send, daemon=True).start()


def _exit_with_server(server: Server) -> None:
    """The server ended by itself: so does the bridge, with its status."""
    code = server.proc.wait()
    if not server.stopping:
        sys.stderr.write(f"runstead opencode bridge: the server ended by itself "
                         f"({f'signal {-code}' if code < 0 else f'exit {code}'})\n")
        sys.stderr.flush()
        os._exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
