"""What the real ``opencode serve`` (1.18.33, offline) prints through RunStead's bridge,
recorded by tests/record_opencode_serve.py into tests/fixtures/opencode_serve/, read by
the live adapter (``live_agents.OpencodeServe``) and the ``opencode_serve`` parser
(SPEC C1, C4, C11, G2-G4); and how the bridge starts the server (K: loopback only, with a
password), docs/opencode-server.md."""
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

from machine import opencode_bridge
from machine.worker.live_agents import OpencodeServe, for_preset
from machine.worker.parsers import make_parser
from machine.worker.presets import OPENCODE_BRIDGE, PRESETS
from tests.wait import wait_for

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "opencode_serve"
PROMPTS = {
    "three_turns": ["first", "[[bash:echo hi]] a tool", "third"],
    "abort": ["[[bash:sleep 30]] long", "after"],
    "refused": ["[[error:400]] refused"],
    "permission_rejected": ["[[bash:echo hi]] a tool", "after"],
}


def lines(name: str) -> list[str]:
    return (FIXTURES / f"{name}.jsonl").read_text().splitlines()


def events(name: str) -> list[dict]:
    return [json.loads(line) for line in lines(name)]


def adapter_events(name: str) -> list:
    agent = OpencodeServe()
    return [e for e in (agent.see(line) for line in lines(name)) if e is not None]


def parsed(name: str):
    parser = make_parser("opencode_serve")
    for seq, text in enumerate(PROMPTS[name]):
        parser.turn_prompt(seq, text)
    for line in lines(name):
        parser.feed_line(line)
    parser.close()
    return parser


def test_c11_each_prompt_after_the_last_turn_ended_ends_one_turn_once():
    """Three prompts, each sent after the previous turn's end: three turn ends, though each
    terminal assistant message is announced twice and a tool turn has two assistant
    messages (the first ``finish: tool-calls``)."""
    stream = events("three_turns")
    terminal = [e for e in stream if e["type"] == "message.updated" and e["properties"]["info"]["role"] == "assistant"
                and e["properties"]["info"].get("time", {}).get("completed")]
    assert [e["properties"]["info"]["finish"] for e in terminal] == ["stop"] * 2 + ["tool-calls"] * 2 + ["stop"] * 4
    assert adapter_events("three_turns") == [("result", None)] * 3
    assert stream[0] == {"type": "bridge.ready", "properties": {"sessionID": stream[1]["properties"]["sessionID"]}}
    assert len({e["properties"]["sessionID"] for e in stream}) == 1  # the bridge keeps only its session's events


def test_c4_abort_ends_the_turn_once_though_session_idle_comes_twice_and_keeps_the_session():
    stream = events("abort")
    kinds = [e["type"] for e in stream]
    assert kinds.count("session.idle") == 3  # twice after the abort, once after "after": no turn-end signal
    errors = [e["properties"]["error"]["name"] for e in stream if e["type"] == "session.error"]
    assert errors == ["MessageAbortedError"]
    assert adapter_events("abort") == [("result", None)] * 2
    tool = [e["properties"]["part"] for e in stream if e["type"] == "message.part.updated"
            and e["properties"]["part"]["type"] == "tool"][-1]
    assert tool["state"]["status"] == "error"  # opencode ends the running command with the turn


def test_q5_c11_a_loop_stopped_by_a_rejected_permission_ends_its_turn_at_idle_once():
    """opencode's bash asks (``permission.asked``), the bridge (no task credential) rejects
    it: the tool part ends ``error``, the assistant message completes with ``finish``
    ``tool-calls`` and no other follows; the session going idle ends that turn, once
    (``session.status`` idle and ``session.idle`` both come), and the next prompt is a
    turn of its own."""
    stream = events("permission_rejected")
    asked = [e["properties"] for e in stream if e["type"] == "permission.asked"]
    replied = [e["properties"] for e in stream if e["type"] == "permission.replied"]
    assert [(a["permission"], a["patterns"], a["metadata"]["command"]) for a in asked] == \
        [("bash", ["echo hi"], "echo hi")]
    assert [(r["requestID"], r["reply"]) for r in replied] == [(asked[0]["id"], "reject")]
    assert adapter_events("permission_rejected") == [("result", None)] * 2
    parser = make_parser("opencode_serve")
    stream_lines = lines("permission_rejected")
    cut = next(i for i, line in enumerate(stream_lines) if '"session.idle"' in line)
    for line in stream_lines[:cut + 1]:
        parser.feed_line(line)
    assert parser.turns == 1
    assert parser.facts()["agent_result"] == {"is_error": False, "subtype": "tool-calls", "summary": ""}
    for line in stream_lines[cut + 1:]:
        parser.feed_line(line)
    assert parser.facts()["agent_result"] == {"is_error": False, "subtype": "stop", "summary": "ok: after"}


def test_c4_the_bridge_holds_an_abort_until_its_prompts_turn_has_started():
    """Issue 43: an abort between a prompt and its turn's start (busy, or an assistant
    message) waits for that start; with no prompt waiting it goes at once; a prompt the
    server refused drops it; a prompt while the session is busy joins the running turn."""
    now = [100.0]
    gate = opencode_bridge.AbortGate(clock=lambda: now[0])

    def status(kind):
        return {"type": "session.status", "properties": {"sessionID": "ses_x", "status": {"type": kind}}}

    assert gate.abort() is True  # nothing waiting: sent (the server answers 200, nothing happens)
    gate.prompted()
    assert gate.abort() is False and gate.abort() is False  # held, once
    now[0] = 101.5
    user = {"type": "message.updated", "properties": {"sessionID": "ses_x", "info": {"role": "user"}}}
    assert gate.see(user) is None and gate.see(status("idle")) is None
    assert gate.see(status("busy")) == 1.5  # the turn began: send it now
    assert gate.see(status("busy")) is None and gate.abort() is True  # a turn runs: at once
    assert gate.see(status("idle")) is None
    gate.prompted()
    assert gate.abort() is False
    refused = {"type": "bridge.error", "properties": {"sessionID": "ses_x", "request": "prompt", "status": 400}}
    assert gate.see(refused) is None and gate.see(status("busy")) is None  # no turn: dropped
    gate.prompted()  # while busy: the prompt joins the running loop
    assert gate.abort() is True
    gate.see(status("idle"))
    gate.prompted()
    assert gate.abort() is False
    assistant = {"type": "message.updated", "properties": {"sessionID": "ses_x", "info": {"role": "assistant"}}}
    assert gate.see(assistant) == 0.0


def test_q5_the_bridge_replies_to_opencode_as_the_owner_answered():
    reply = opencode_bridge.permission_reply
    assert reply({"state": "allowed", "scope": "once"}) == {"reply": "once"}
    assert reply({"state": "allowed", "scope": "session"}) == {"reply": "always"}
    assert reply({"state": "denied", "message": "no"}) == {"reply": "reject", "message": "no"}
    assert reply({"state": "denied", "message": ""}) == {"reply": "reject"}
    for unanswered in ({"state": "expired"}, {"state": "withdrawn"}, {"state": "pending"}, None, "junk"):
        assert reply(unanswered) == {"reply": "reject"}  # no answer: what headless opencode does
    asked = {"id": "per_1", "sessionID": "ses_x", "permission": "bash", "patterns": ["ls"],
             "metadata": {"command": "ls"}, "always": ["ls *"], "tool": {"messageID": "msg_1", "callID": "c"}}
    assert opencode_bridge.ask_payload(asked, "/w") == {
        "session_id": "ses_x", "prompt_id": "msg_1", "tool_name": "bash",
        "tool_input": {"patterns": ["ls"], "metadata": {"command": "ls"}}, "cwd": "/w"}


def test_q5_w5_the_servers_environment_never_holds_the_task_credential():
    env = opencode_bridge.serve_env({"RUNSTEAD_TASK_CREDENTIAL": "secret", "RUNSTEAD_TASK_ID": "t", "PATH": "/bin"},
                                    "pw")
    assert "RUNSTEAD_TASK_CREDENTIAL" not in env and env["RUNSTEAD_TASK_ID"] == "t"
    assert env["OPENCODE_SERVER_PASSWORD"] == "pw" and env["OPENCODE_SERVER_USERNAME"] == "opencode"


def test_c11_a_turn_refused_by_the_model_api_ends_its_turn():
    assert adapter_events("refused") == [("result", None)]


def test_c11_a_prompt_the_server_refused_ends_a_turn_that_never_began():
    agent = OpencodeServe()
    refused = json.dumps({"type": "bridge.error", "properties": {"sessionID": "ses_x", "request": "prompt",
                                                                 "status": 400, "body": "bad"}})
    abort_refused = json.dumps({"type": "bridge.error", "properties": {"sessionID": "ses_x", "request": "abort",
                                                                       "status": 500, "body": ""}})
    assert [agent.see(refused), agent.see(abort_refused), agent.see("not json"), agent.see("[1]")] == \
        [("result", None), None, None, None]
    assert agent.turns_ended == 1
    parser = make_parser("opencode_serve")
    parser.turn_prompt(0, "hi")
    parser.feed_line(refused)
    assert parser.facts()["agent_result"] == {"is_error": True, "subtype": "prompt_refused",
                                              "summary": "opencode refused the prompt (400): bad"}


def test_g2_g3_g4_the_serve_parser_reads_session_turns_tools_tokens_cost_and_verdict():
    parser = parsed("three_turns")
    session = events("three_turns")[0]["properties"]["sessionID"]
    assert parser.facts() == {
        "agent_session_id": session,
        "agent_result": {"is_error": False, "subtype": "stop", "summary": "ok: third"},
        "usage": {"turns": 3, "tool_calls": 1, "input_tokens": 160, "output_tokens": 32, "cost_usd": 0.00096},
        "last_message": "ok: third",
    }
    assert parser.unknown_events == 0
    assert [(e["kind"], e["text"], e.get("seq")) for e in parser.entries] == [
        ("prompt", "first", 0), ("message", "ok: first", None),
        ("prompt", "[[bash:echo hi]] a tool", 1), ("tool_call", "echo hi", None), ("tool_result", "hi\n", None),
        ("message", "done.", None),
        ("prompt", "third", 2), ("message", "ok: third", None),
    ]


def test_c4_g3_an_aborted_turn_is_interrupted_not_an_error_and_the_next_turn_decides():
    parser = make_parser("opencode_serve")
    stream = lines("abort")
    cut = max(i for i, line in enumerate(stream) if '"MessageAbortedError"' in line and '"message.updated"' in line)
    for line in stream[:cut + 1]:
        parser.feed_line(line)
    assert parser.facts()["agent_result"] == {"is_error": False, "subtype": "interrupted", "summary": ""}
    for line in stream[cut + 1:]:
        parser.feed_line(line)
    assert parser.facts()["agent_result"] == {"is_error": False, "subtype": "stop", "summary": "ok: after"}
    assert [e["kind"] for e in parser.entries if e["kind"] == "error"] == []  # the abort is no error entry


def test_g3_a_model_api_error_is_the_turns_error_verdict():
    parser = parsed("refused")
    assert parser.facts()["agent_result"] == {"is_error": True, "subtype": "APIError", "summary": "fake refusal"}
    assert [(e["kind"], e["text"]) for e in parser.entries] == [("prompt", "[[error:400]] refused"),
                                                                ("error", "fake refusal")]


def test_c1_c11_the_opencode_preset_is_live_through_the_bridge_one_prompt_line_per_message():
    preset = PRESETS["opencode"]
    assert preset.conversation == "live"
    assert preset.live_argv == (sys.executable, "-I", OPENCODE_BRIDGE, "{binary}")
    assert os.path.isfile(OPENCODE_BRIDGE)
    agent = for_preset("opencode")
    assert isinstance(agent, OpencodeServe) and agent.parser == "opencode_serve" and agent.end_waits_for_turn
    assert agent.opening("/f") == ""
    message = {"kind": "message", "line": json.dumps({"type": "user", "message": {"role": "user",
                                                                                   "content": "hello\nthere"}})}
    assert json.loads(agent.line(message, [])) == {"prompt": "hello\nthere"}
    assert json.loads(agent.line({"kind": "interrupt", "line": None}, [])) == {"abort": True}


def test_k_c11_the_bridge_starts_opencode_serve_on_127_0_0_1_with_its_own_password():
    assert opencode_bridge.serve_argv("/bin/opencode") == [
        "/bin/opencode", "serve", "--hostname", "127.0.0.1", "--port", "0", "--no-mdns"]
    env = opencode_bridge.serve_env({"HOME": "/h", "OPENCODE_SERVER_PASSWORD": "", "OPENCODE_SERVER_USERNAME": "x"},
                                    "s3cret")
    assert env == {"HOME": "/h", "OPENCODE_SERVER_PASSWORD": "s3cret", "OPENCODE_SERVER_USERNAME": "opencode"}
    assert not opencode_bridge.keep({"type": "plugin.added", "properties": {"id": "x"}}, "ses_a")
    assert not opencode_bridge.keep({"type": "message.part.delta", "properties": {"sessionID": "ses_a"}}, "ses_a")
    assert not opencode_bridge.keep({"type": "session.idle", "properties": {"sessionID": "ses_b"}}, "ses_a")
    assert opencode_bridge.keep({"type": "session.idle", "properties": {"sessionID": "ses_a"}}, "ses_a")


FAKE_SERVE = """#!{python}
import json, os, sys, time
with open(os.environ["RECORD"], "w") as f:
    json.dump({{"argv": sys.argv[1:], "password": os.environ.get("OPENCODE_SERVER_PASSWORD"),
               "user": os.environ.get("OPENCODE_SERVER_USERNAME"), "pid": os.getpid()}}, f)
print("opencode server listening on http://{host}:4096", flush=True)
time.sleep(30)
"""


def test_k_c11_the_bridge_refuses_a_server_listening_anywhere_but_loopback_and_prints_no_password(tmp_path):
    """A fake ``opencode`` that says it listens on 0.0.0.0 (as a config's ``server.hostname``
    or mDNS would make it): the bridge stops it and exits non-zero; the password it was
    given is fresh for each start and never printed."""
    fake = fake_serve(tmp_path, "0.0.0.0")
    passwords = []
    for n in range(2):
        record = tmp_path / f"record{n}.json"
        run = subprocess.run([sys.executable, "-I", OPENCODE_BRIDGE, str(fake)], capture_output=True, timeout=30,
                             env={**os.environ, "RECORD": str(record), "OPENCODE_SERVER_PASSWORD": "inherited"})
        assert run.returncode != 0
        assert b"not 127.0.0.1" in run.stderr
        seen = json.loads(record.read_text())
        assert seen["argv"] == ["serve", "--hostname", "127.0.0.1", "--port", "0", "--no-mdns"]
        assert seen["user"] == "opencode" and len(seen["password"]) >= 32 and seen["password"] != "inherited"
        assert seen["password"].encode() not in run.stdout + run.stderr
        passwords.append(seen["password"])
    assert passwords[0] != passwords[1]


def fake_serve(tmp_path, host: str, port: int = 4096) -> Path:
    fake = tmp_path / "opencode"
    fake.write_text(FAKE_SERVE.format(python=sys.executable, host=host).replace(":4096", f":{port}"))
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    return fake


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
def test_l8_the_server_leads_its_own_group_and_never_outlives_the_bridge(tmp_path, how):
    """The server (a fake that says it listens on a loopback port where nothing answers, so
    the bridge waits for its event stream) is in a process group of its own, so what it
    signals to its group never reaches the launcher's; the bridge killed (SIGKILL: the
    kernel's parent-death signal) or stopped (SIGTERM: it stops the server's group) takes
    the server with it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    record = tmp_path / "record.json"
    bridge = subprocess.Popen([sys.executable, "-I", OPENCODE_BRIDGE, str(fake_serve(tmp_path, "127.0.0.1", port))],
                              env={**os.environ, "RECORD": str(record)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, start_new_session=True)
    try:
        seen = wait_for(lambda: record.exists() and json.loads(record.read_text() or "null"), timeout_s=20,
                        ignore=(ValueError,), what="the fake server started")
        server = psutil.Process(seen["pid"])
        assert server.ppid() == bridge.pid
        assert os.getpgid(server.pid) == server.pid != os.getpgid(bridge.pid)
        bridge.send_signal(how)
        assert bridge.wait(20) == (-signal.SIGKILL if how == signal.SIGKILL else 128 + signal.SIGTERM)
        wait_for(lambda: not server.is_running() or server.status() == psutil.STATUS_ZOMBIE, timeout_s=10,
                 what="the server gone with the bridge")
    finally:
        if bridge.poll() is None:
            bridge.kill()
            bridge.wait()


FAKE_HTTP_SERVE = """#!{python}
# A stand-in for ``opencode serve`` speaking its HTTP as recorded: basic auth with the
# password it was given, /event (the first stream drops once the session exists),
# POST /session, GET /session/ID/message (the recorded listing).
import base64, json, os, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
AUTH = "Basic " + base64.b64encode(("opencode:" + os.environ["OPENCODE_SERVER_PASSWORD"]).encode()).decode()
LISTING = open({listing!r}).read()
created, streams = threading.Event(), []
log = open(os.environ["RECORD"], "a")

class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a): pass
    def reply(self, status, body=b"", kind="application/json"):
        self.send_response(status); self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body))); self.end_headers(); self.wfile.write(body)
    def allowed(self):
        ok = self.headers.get("Authorization") == AUTH
        log.write(json.dumps([self.command, self.path, ok]) + "\\n"); log.flush()
        if not ok: self.reply(401)
        return ok
    def do_POST(self):
        if self.allowed():
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            created.set(); self.reply(200, json.dumps({{"id": "ses_fake"}}).encode())
    def do_GET(self):
        if not self.allowed(): return
        if self.path == "/session/ses_fake/message":
            return self.reply(200, LISTING.encode())
        streams.append(1)
        self.send_response(200); self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close"); self.end_headers()
        self.wfile.write(b'data: {{"type":"server.connected","properties":{{}}}}\\n\\n'); self.wfile.flush()
        if len(streams) == 1:
            created.wait(30); time.sleep(0.3); self.close_connection = True; return  # the stream drops
        while True:
            time.sleep(0.5)
            self.wfile.write(b'data: {{"type":"server.heartbeat","properties":{{}}}}\\n\\n'); self.wfile.flush()

server = ThreadingHTTPServer(("127.0.0.1", 0), H)
print("opencode server listening on http://127.0.0.1:%d" % server.server_address[1], flush=True)
server.serve_forever()
"""


def test_c11_c6_the_bridge_calls_with_its_password_and_a_dropped_event_stream_loses_no_turn_end(tmp_path):
    """A stand-in server (real HTTP, the recorded shapes): every request the bridge makes
    carries the password's basic auth; after the event stream drops and comes back, the
    bridge prints the session's messages again (``resync``), so the turn that ended
    meanwhile ends here once (C6: the session never stays busy)."""
    fake = tmp_path / "opencode"
    fake.write_text(FAKE_HTTP_SERVE.format(python=sys.executable, listing=str(FIXTURES / "listing.json")))
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    record = tmp_path / "requests.jsonl"
    bridge = subprocess.Popen([sys.executable, "-I", OPENCODE_BRIDGE, str(fake)], env={**os.environ,
                              "RECORD": str(record)}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              start_new_session=True)
    agent, parser, out = OpencodeServe(), make_parser("opencode_serve"), []
    parser.turn_prompt(0, "hi")
    watchdog = threading.Timer(30, bridge.kill)  # no turn end: its stdout ends, the asserts say why
    watchdog.start()
    try:
        for raw in bridge.stdout:
            line = raw.decode().rstrip("\n")
            out.append(line)
            parser.feed_line(line)
            if agent.see(line) == ("result", None):
                break
        requests = [json.loads(x) for x in record.read_text().splitlines()]
    finally:
        watchdog.cancel()
        bridge.stdin.close()
        assert bridge.wait(20) == 0
    calls = [r[:2] for r in requests]
    assert calls[:4] == [["GET", "/event"], ["POST", "/session"], ["GET", "/event"], ["GET", "/session/ses_fake/message"]]
    # The resync's later reads (the status, pending permissions) may or may not have gone
    # out when the turn's end was read; the stand-in does not serve them.
    assert all(call in (["GET", "/session/status"], ["GET", "/permission"]) for call in calls[4:]), calls
    assert all(ok for _, _, ok in requests)  # the password on every request
    assert json.loads(out[0]) == {"type": "bridge.ready", "properties": {"sessionID": "ses_fake"}}
    assert agent.turns_ended == 1
    assert parser.facts()["agent_result"] == {"is_error": False, "subtype": "stop", "summary": "ok: hi"}
    assert parser.facts()["usage"]["cost_usd"] > 0
