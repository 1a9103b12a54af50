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
  server refuses prints ``{"type": "bridge.error", "request": "prompt"|"abort", "status",
  "body"}`` (a refused prompt makes no turn). EOF: the server is stopped (SIGTERM, then
  SIGKILL after ``STOP_GRACE_S``) and the bridge exits with its status;
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
    ``OPENCODE_SERVER_USERNAME`` or password inherited is replaced)."""
    return {**environ, "OPENCODE_SERVER_PASSWORD": password, "OPENCODE_SERVER_USERNAME": USERNAME}


class Server:
    """The running ``opencode serve`` and how to call it."""

    def __init__(self, binary: str):
        self.stopping = False  # the bridge stops it (stdin ended)
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
                        emit(event)
            except (OSError, http.client.HTTPException) as exc:
                sys.stderr.write(f"runstead opencode bridge: event stream: {exc}\n")
            finally:
                conn.close()
            time.sleep(0.2)

    def resync(self, session_id: str) -> None:
        """After the event stream dropped and came back: the session's messages as the
        server lists them (``GET /session/{id}/message``), printed as the events that
        would have said the same (each part's ``message.part.updated``, then its message's
        ``message.updated``), so a turn that ended meanwhile still ends here (the adapter
        and the parser count each turn end and part once)."""
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
                emit({"type": "message.part.updated", "properties": {"sessionID": session_id, "part": part}})
            emit({"type": "message.updated", "properties": {"sessionID": session_id, "info": message["info"]}})

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
        elif item.get("abort") is True:
            what, path, body = "abort", f"/session/{session['id']}/abort", None
        else:
            continue
        try:
            status, answer = server.request("POST", path, body)
        except (OSError, http.client.HTTPException) as exc:
            status, answer = 0, str(exc).encode()
        if status >= 300 or status == 0:
            emit({"type": "bridge.error", "properties": {"sessionID": session["id"], "request": what,
                                                         "status": status,
                                                         "body": answer[:500].decode("utf-8", "replace")}})
    server.stopping = True
    server.stop()
    return 0  # the end asked for (C5): the server stopped as it should


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
