"""SPEC I2-I4, I6: each CLI's recorded hook payloads mapped to the writes they imply
(pure functions, no service). The live board sequences are in test_hooks_live.py."""
import json
import uuid
from pathlib import Path

import pytest

from machine.hooks import RUNSTEAD_NAMESPACE, mapping
from tests.hooks_support import fixture

pytestmark = pytest.mark.backend_independent  # neither database nor layer (pytest.ini)

HOST = "mac"


def call(agent, payload, state):
    event = mapping.identify(agent, payload)
    return mapping.handle(event, payload, state, hostname=HOST)


def kinds(writes):
    """Each write as a short tag: create, sweep, running:<turn>, ended:<turn>, job:<id>,
    finish:<id>, title, attention, clear."""
    out = []
    for w in writes:
        body = w["body"] or {}
        if w["path"] == "/api/sessions/":
            out.append("create")
        elif w["path"].endswith("/sweep/"):
            out.append("sweep")
        elif w["path"].endswith("/marker/"):
            out.append(f"{body['state']}:{body['turn_id']}")
        elif w["path"].endswith("/finish/"):
            out.append(f"finish:{w['path'].split('/')[-3]}:{body['wakes']}")
        elif w["path"].endswith("/jobs/"):
            out.append(f"job:{body['job_id']}:{body['mode']}")
        elif "title" in body:
            out.append("title")
        elif body.get("attention"):
            out.append("attention")
        else:
            out.append("clear")
    return out


def test_i2_ids_are_uuid5_of_agent_and_session_and_device_is_per_instance():
    state = {}
    writes = call("claude", fixture("claude", "session_start_startup"), state)
    sid = str(uuid.uuid5(uuid.UUID("80bf71b1-6975-58ca-9896-94d5739ee39a"), "claude:abc123"))
    assert uuid.UUID(RUNSTEAD_NAMESPACE) == uuid.UUID("80bf71b1-6975-58ca-9896-94d5739ee39a")
    assert writes[0] == {"method": "POST", "path": "/api/sessions/",
                         "body": {"id": sid, "title": "app", "agent": "claude", "cwd": "/Users/me/src/app"}}
    assert writes[1] == {"method": "POST", "path": "/api/devices/mac:claude:abc123/sweep/", "body": None}
    prompt = call("claude", fixture("claude", "user_prompt_submit"), state)
    assert prompt[0]["path"] == f"/api/sessions/{sid}/marker/"
    assert prompt[0]["body"]["device_id"] == "mac:claude:abc123"


def test_i3_claude_session_start_sweeps_on_startup_and_resume_only():
    for source, expected in (("startup", ["create", "sweep"]), ("resume", ["create", "sweep"]),
                             ("clear", ["create"]), ("compact", ["create"])):
        assert kinds(call("claude", fixture("claude", "session_start_startup", source=source), {})) == expected


def test_i3_claude_turn_is_running_then_ended_with_prompt_id_and_title_once():
    state = {}
    call("claude", fixture("claude", "session_start_startup"), state)
    turn = fixture("claude", "user_prompt_submit")["prompt_id"]
    writes = call("claude", fixture("claude", "user_prompt_submit"), state)
    assert kinds(writes) == [f"running:{turn}", "title"]
    assert writes[1]["body"] == {"title": "Run the test suite in the background and fix whatever fails"}
    assert state["turn"] == turn
    assert kinds(call("claude", fixture("claude", "stop"), state)) == [f"ended:{turn}"]
    second = call("claude", fixture("claude", "user_prompt_submit", prompt_id="p2", prompt="x" * 200), state)
    assert kinds(second) == ["running:p2"]  # the title came from the first prompt only


def test_i3_title_is_80_characters_of_the_first_prompt():
    state = {"created": True}
    writes = call("claude", fixture("claude", "user_prompt_submit", prompt="word " * 40), state)
    assert len(writes[1]["body"]["title"]) == 80


def test_i3_s3_background_task_held_before_ended_then_finished_before_wake_turn_ends():
    state = {}
    call("claude", fixture("claude", "session_start_startup"), state)
    turn1 = fixture("claude", "user_prompt_submit")["prompt_id"]
    call("claude", fixture("claude", "user_prompt_submit"), state)
    # Stop with the background task running: the held job comes BEFORE `ended` (no blip).
    assert kinds(call("claude", fixture("claude", "stop_background_running"), state)) == [
        "job:bstq0thj2:held", f"ended:{turn1}"
    ]
    wake = fixture("claude", "user_prompt_submit_wake")["prompt_id"]
    assert kinds(call("claude", fixture("claude", "user_prompt_submit_wake"), state)) == [f"running:{wake}"]
    # The wake turn's Stop no longer lists it: finished (wakes false) while the wake turn
    # still runs, then `ended`.
    assert kinds(call("claude", fixture("claude", "stop_background_gone"), state)) == [
        "finish:bstq0thj2:False", f"ended:{wake}"
    ]
    assert state.get("jobs") == []


def test_i3_stop_without_open_turn_still_reconciles_jobs():
    state = {"created": True, "jobs": ["bstq0thj2"]}
    assert kinds(call("claude", fixture("claude", "stop_background_gone"), state)) == ["finish:bstq0thj2:False"]


def test_i3_a_known_running_job_is_not_written_again():
    state = {"created": True, "jobs": ["bstq0thj2"], "turn": "t"}
    assert kinds(call("claude", fixture("claude", "stop_background_running"), state)) == ["ended:t"]


def test_i3_stop_without_background_tasks_field_leaves_jobs_alone():
    payload = fixture("claude", "stop")
    del payload["background_tasks"]
    state = {"created": True, "jobs": ["j1"], "turn": "t"}
    assert kinds(call("claude", payload, state)) == ["ended:t"]
    assert state["jobs"] == ["j1"]


def test_i6_permission_prompt_sets_attention_cleared_by_next_prompt_stop_or_end():
    for clearing in ("user_prompt_submit", "stop", "session_end"):
        state = {"created": True, "turn": "t"}
        writes = call("claude", fixture("claude", "notification_permission"), state)
        assert kinds(writes) == ["attention"]
        assert writes[0]["body"] == {"attention": "permission",
                                     "attention_message": "Claude needs your permission to use Bash"}
        assert kinds(call("claude", fixture("claude", clearing), state))[0] == "clear"
        assert "attention" not in state


def test_i6_other_notifications_write_nothing():
    assert call("claude", fixture("claude", "notification_idle"), {"created": True}) == []


def test_i3_session_end_ends_turn_and_finishes_every_open_job():
    state = {"created": True, "turn": "t", "jobs": ["a", "b"]}
    assert kinds(call("claude", fixture("claude", "session_end"), state)) == [
        "ended:t", "finish:a:False", "finish:b:False"
    ]


def test_m5_resume_after_crash_sweeps_and_forgets_the_crashed_turn():
    state = {"created": True, "titled": True, "turn": "crashed"}
    assert kinds(call("claude", fixture("claude", "session_start_resume"), state)) == ["sweep"]
    assert "turn" not in state
    assert kinds(call("claude", fixture("claude", "stop"), state)) == []


# The recorded Codex turn (tests/record_hook_fixtures.py): its thread and turn ids.
CODEX_NOTIFY = fixture("codex", "notify_turn_complete")
CODEX_TURN = CODEX_NOTIFY["turn-id"]


def test_i4_codex_notify_writes_running_then_ended_for_a_turn_never_started():
    state = {}
    writes = call("codex", fixture("codex", "notify_turn_complete"), state)
    assert kinds(writes) == ["create", f"running:{CODEX_TURN}", f"ended:{CODEX_TURN}"]
    assert writes[0]["body"]["title"] == CODEX_NOTIFY["input-messages"][0]
    assert writes[0]["body"]["id"] == str(uuid.uuid5(uuid.UUID(RUNSTEAD_NAMESPACE), f"codex:{CODEX_NOTIFY['thread-id']}"))
    assert call("codex", fixture("codex", "notify_turn_complete"), state) == []  # a repeat adds nothing


def test_i4_codex_hooks_then_notify_end_the_turn_once():
    state = {}
    assert kinds(call("codex", fixture("codex", "session_start"), state)) == ["create", "sweep"]
    assert kinds(call("codex", fixture("codex", "user_prompt_submit"), state)) == [f"running:{CODEX_TURN}", "title"]
    assert kinds(call("codex", fixture("codex", "stop"), state)) == [f"ended:{CODEX_TURN}"]
    assert call("codex", fixture("codex", "notify_turn_complete"), state) == []


def test_i4_codex_notify_ends_a_turn_its_prompt_hook_started():
    state = {}
    call("codex", fixture("codex", "user_prompt_submit"), state)
    assert kinds(call("codex", fixture("codex", "notify_turn_complete"), state)) == [f"ended:{CODEX_TURN}"]


def test_i4_gemini_before_after_agent_and_tool_permission():
    state = {}
    assert kinds(call("gemini", fixture("gemini", "session_start"), state)) == ["create", "sweep"]
    writes = call("gemini", fixture("gemini", "before_agent"), state)
    turn = state["turn"]
    assert kinds(writes) == [f"running:{turn}", "title"]
    assert kinds(call("gemini", fixture("gemini", "notification_tool_permission"), state)) == ["attention"]
    assert kinds(call("gemini", fixture("gemini", "after_agent"), state)) == ["clear", f"ended:{turn}"]
    assert kinds(call("gemini", fixture("gemini", "session_end"), state)) == []


def test_i6_gemini_tool_permission_attention_names_what_is_asked():
    """Gemini CLI 0.61.0's ToolPermission message is generic ("Tool Confirm Shell Command
    requires execution"); the command (an edit's file, an MCP tool) comes from ``details``."""
    real = fixture("gemini", "notification_tool_permission")  # captured interactively
    assert real["message"] == "Tool Confirm Shell Command requires execution"

    def message(payload):
        writes = call("gemini", payload, {"created": True})
        assert kinds(writes) == ["attention"]
        return writes[0]["body"]["attention_message"]

    assert message(real) == "Tool Confirm Shell Command requires execution: echo hello > hello.txt"
    edit = {"type": "edit", "title": "Edit", "fileName": "app.py", "filePath": "/home/dev/project/app.py"}
    assert message({**real, "message": "Tool Edit requires editing", "details": edit}) == (
        "Tool Edit requires editing: app.py")
    mcp = {"type": "mcp", "title": "Confirm MCP Tool", "serverName": "gh", "toolName": "create_issue",
           "toolDisplayName": "create_issue (gh MCP Server)"}
    assert message({**real, "message": "Tool Confirm MCP Tool requires MCP", "details": mcp}) == (
        "Tool Confirm MCP Tool requires MCP: create_issue (gh MCP Server)")
    for details in ({"type": "info", "prompt": "fetch?"}, {"type": "exec", "command": 7}, "no", None):
        assert message({**real, "details": details}) == real["message"]
    assert message({**real, "message": None}) == "permission needed: echo hello > hello.txt"
    assert call("gemini", {**real, "notification_type": "Other"}, {"created": True}) == []


def test_i4_gemini_turn_ids_are_fresh_per_turn():
    state = {"created": True, "titled": True}
    call("gemini", fixture("gemini", "before_agent"), state)
    first = state["turn"]
    call("gemini", fixture("gemini", "after_agent"), state)
    call("gemini", fixture("gemini", "before_agent"), state)
    assert state["turn"] != first


def test_i4_opencode_status_busy_idle_retry_and_permission():
    state = {}
    assert kinds(call("opencode", fixture("opencode", "session_created"), state)) == ["create"]
    writes = call("opencode", fixture("opencode", "session_status_busy"), state)
    turn = state["turn"]
    assert kinds(writes) == [f"running:{turn}"]
    assert call("opencode", fixture("opencode", "session_status_retry"), state) == []
    assert call("opencode", fixture("opencode", "session_status_busy"), state) == []  # same turn
    assert kinds(call("opencode", fixture("opencode", "permission_asked"), state)) == ["attention"]
    assert kinds(call("opencode", fixture("opencode", "session_status_idle"), state)) == ["clear", f"ended:{turn}"]
    assert call("opencode", fixture("opencode", "session_idle"), state) == []  # the same end, once


def test_i6_opencode_permission_replied_clears_the_attention():
    state = {}
    call("opencode", fixture("opencode", "session_status_busy"), state)
    assert kinds(call("opencode", fixture("opencode", "permission_asked"), state)) == ["attention"]
    assert kinds(call("opencode", fixture("opencode", "permission_replied"), state)) == ["clear"]


@pytest.mark.parametrize("agent,payload,message", [
    ("claude", [], "not a JSON object"),
    ("claude", {"hook_event_name": "Stop"}, "no session id"),
    ("claude", {"session_id": "s", "hook_event_name": "PreCompact"}, "unknown event"),
    ("claude", {"session_id": "s"}, "names no event"),
    ("codex", {"type": "something-else", "thread-id": "t"}, "unknown event"),
    ("aider", {"session_id": "s", "hook_event_name": "Stop"}, "unknown agent"),
])
def test_i1_bad_payloads_are_refused(agent, payload, message):
    with pytest.raises(mapping.BadInput, match=message):
        mapping.identify(agent, payload)


def test_i2_unsafe_agent_ids_become_stable_valid_tokens():
    assert mapping.turn_token("a b/c") == mapping.turn_token("a b/c")
    assert uuid.UUID(mapping.turn_token("a b/c"))
    assert mapping.device_id("my mac", "claude", "x/y") == "my-mac:claude:x-y"


# --- I7: long turns --------------------------------------------------------------------------

def at(agent, payload, state, now, class_s=100.0):
    event = mapping.identify(agent, payload)
    return mapping.handle(event, payload, state, hostname=HOST, now=now, class_s=class_s)


@pytest.mark.parametrize("agent,start,tool,stop", [
    ("claude", ("user_prompt_submit", {}), {"hook_event_name": "PreToolUse", "tool_name": "Bash"}, "stop"),
    ("codex", ("user_prompt_submit", {}), fixture("codex", "post_tool_use"), "stop"),
    ("gemini", ("before_agent", {}), fixture("gemini", "before_tool"), "after_agent"),
])
def test_i7_tool_hook_continues_a_turn_past_half_its_class_and_stop_ends_the_new_id(agent, start, tool, stop):
    state = {}
    at(agent, fixture(agent, start[0], **start[1]), state, now=1000.0)
    first = state["turn"]
    session = fixture(agent, start[0])["session_id"]
    tool_payload = {"cwd": "/x", **tool, "session_id": session}
    assert mapping.nothing_due(mapping.identify(agent, tool_payload), tool_payload, state, now=1049.0, class_s=100.0)
    assert at(agent, tool_payload, state, now=1049.0) == []  # not yet half of 100 s
    assert state["turn"] == first
    writes = at(agent, tool_payload, state, now=1050.0)
    second = state["turn"]
    assert kinds(writes) == [f"running:{second}"] and second != first  # one write, a fresh id
    assert writes[0]["body"]["device_id"] == mapping.device_id(HOST, agent, session)  # the same device (M7)
    assert at(agent, tool_payload, state, now=1099.0) == []  # half a class from the continuation
    third = kinds(at(agent, tool_payload, state, now=1100.0))
    assert third == [f"running:{state['turn']}"]
    ended = kinds(at(agent, fixture(agent, stop, session_id=session), state, now=1101.0))
    assert ended[-1] == f"ended:{third[0].split(':')[1]}"
    assert "turn" not in state and "turn_origin" not in state


def test_i7_codex_notify_after_a_continued_turn_adds_nothing():
    """Stop ended the continued turn; notify names the agent's own turn id, which is
    known as ended with it: no second running/ended pair (no blip, no second idle)."""
    state = {}
    prompt = fixture("codex", "user_prompt_submit")
    at("codex", prompt, state, now=0.0)
    codex_turn = state["turn"]
    tool = {"session_id": prompt["session_id"], "hook_event_name": "PreToolUse", "cwd": "/x"}
    at("codex", tool, state, now=60.0)
    assert state["turn_origin"] == codex_turn != state["turn"]
    at("codex", fixture("codex", "stop", session_id=prompt["session_id"]), state, now=61.0)
    notify = fixture("codex", "notify_turn_complete", **{"thread-id": prompt["session_id"], "turn-id": codex_turn})
    assert at("codex", notify, state, now=62.0) == []


def test_i7_codex_notify_alone_ends_a_continued_turn_by_the_agents_id():
    state = {}
    prompt = fixture("codex", "user_prompt_submit")
    at("codex", prompt, state, now=0.0)
    codex_turn = state["turn"]
    at("codex", {"session_id": prompt["session_id"], "hook_event_name": "PostToolUse", "cwd": "/x"}, state, now=70.0)
    continued = state["turn"]
    notify = fixture("codex", "notify_turn_complete", **{"thread-id": prompt["session_id"], "turn-id": codex_turn})
    assert kinds(at("codex", notify, state, now=71.0)) == [f"ended:{continued}"]


def test_i7_tool_hook_without_an_open_turn_writes_nothing():
    payload = {"session_id": "s", "hook_event_name": "PostToolUse", "cwd": "/x"}
    assert at("claude", payload, {}, now=10_000.0) == []
    assert mapping.nothing_due(mapping.identify("claude", payload), payload, {}, now=10_000.0, class_s=100.0)


def test_i7_opencode_busy_starts_a_turn_then_continues_it():
    state = {}
    busy = fixture("opencode", "session_status_busy")
    event = mapping.identify("opencode", busy)
    assert mapping.is_activity(event, busy) and not mapping.nothing_due(event, busy, state, now=0.0, class_s=100.0)
    first = kinds(at("opencode", busy, state, now=0.0))
    assert first[-1] == f"running:{state['turn']}"
    assert at("opencode", busy, state, now=10.0) == []
    assert kinds(at("opencode", busy, state, now=50.0)) == [f"running:{state['turn']}"]
    idle = kinds(at("opencode", fixture("opencode", "session_status_idle"), state, now=51.0))
    assert idle[-1].startswith("ended:")


# --- Q3, Q4: approvals a waiting PermissionRequest hook asked for -----------------------------


@pytest.mark.parametrize("name", ["pre_tool_use", "post_tool_use", "permission_request", "stop", "session_end",
                                  "user_prompt_submit"])
def test_q4_the_sessions_next_hook_answers_its_waiting_approvals_in_the_terminal_first(name):
    ids = [str(uuid.uuid4()), str(uuid.uuid4())]
    state = {"created": True, "turn": "t1", "turn_at": 0.0, "approvals": list(ids)}
    payload = fixture("claude", name)
    event = mapping.identify("claude", payload)
    assert not mapping.nothing_due(event, payload, state, now=1.0, class_s=1200)  # not the I7 fast path
    writes = mapping.handle(event, payload, state, hostname=HOST, now=1.0)
    assert writes[:2] == [{"method": "POST", "path": f"/api/approvals/{i}/terminal/", "body": {}} for i in ids]
    assert "approvals" not in state
    # once told, the next hook sends nothing more for them
    assert not [w for w in mapping.handle(event, payload, state, hostname=HOST, now=2.0) if "/approvals/" in w["path"]]


def test_q3_a_permission_request_with_nothing_waiting_writes_nothing_and_counts_its_key():
    from machine.hooks import approval

    state = {"created": True, "turn": "p-1", "turn_at": 0.0}
    payload = fixture("claude", "permission_request")
    assert call("claude", payload, state) == []
    sid = str(mapping.session_uuid("claude", "abc123"))
    first = approval.prepare(agent="claude", agent_session_id="abc123", session_id=sid, payload=payload, state=state)
    again = approval.prepare(agent="claude", agent_session_id="abc123", session_id=sid, payload=payload, state=state)
    assert first["key"].startswith("claude:abc123:p-1:") and first["key"].endswith(":1")
    assert again["key"] == first["key"][:-1] + "2"  # the same input twice in one turn: two approvals
    state["turn"] = "p-2"  # a new turn counts from 1 again
    assert approval.prepare(agent="claude", agent_session_id="abc123", session_id=sid, payload=payload,
                            state=state)["key"].endswith("p-2:" + first["key"].split(":")[3] + ":1")
    assert (first["session"], first["tool_name"], first["cwd"]) == (sid, "Bash", "/Users/me/src/app")
    assert first["suggestions"] == payload["permission_suggestions"]


def test_q3_decision_output_for_each_end_and_agent():
    from machine.hooks.approval import decision_output

    payload = fixture("claude", "permission_request")
    out = lambda approval, agent="claude": decision_output(approval, payload, agent)  # noqa: E731
    assert json.loads(out({"state": "allowed", "scope": "once"})) == {
        "hookSpecificOutput": {"hookEventName": "PermissionRequest", "decision": {"behavior": "allow"}}}
    session = json.loads(out({"state": "allowed", "scope": "session"}))["hookSpecificOutput"]["decision"]
    assert [s["destination"] for s in session["updatedPermissions"]] == ["session", "session"]
    assert session["updatedPermissions"][0]["rules"] == [{"toolName": "Bash", "ruleContent": "make:*"}]
    # Codex 0.169.0 refuses updatedPermissions ("fail closed"): its allow is the call's only
    assert json.loads(out({"state": "allowed", "scope": "session"}, "codex"))["hookSpecificOutput"]["decision"] == {
        "behavior": "allow"}
    assert json.loads(out({"state": "denied", "message": "not on main"}))["hookSpecificOutput"]["decision"] == {
        "behavior": "deny", "message": "not on main"}
    assert "message" in json.loads(out({"state": "denied", "message": ""}))["hookSpecificOutput"]["decision"]
    for state in ("pending", "expired", "withdrawn", "answered_in_terminal", None):
        assert out({"state": state}) is None


FIXTURES_ROOT = Path(__file__).parent / "fixtures" / "hooks"
_JSON_READ = [b'{"a": 1}', b'  \n{"a": [1, 2.5, -0, 1e400, true, false, null]}\r\n\t', b'"\\ud83d\\ude00 \\u00e9"',
              '{"caf\u00e9": "\u2603"}'.encode(), b'[NaN, Infinity, -Infinity]', b'123456789012345678901234567890',
              b'{"a": {"a": {"a": []}}, "a": 2}', '{"s": "x"}']
_JSON_BAD_OR_ODD = [b"", b"  ", b"{", b"[1,]", b"1 2", b'{"a": 1} x', b'"\x01"', b"\xff\xfe{}", b"\xef\xbb\xbf{}",
                 b'{"a": "\xc3"}', b"nul", "\ufeff{}"]


@pytest.mark.parametrize("data", _JSON_READ + sorted((FIXTURES_ROOT).rglob("*.json")), ids=str)
def test_i7_the_hooks_json_reader_reads_what_json_reads(data):
    """I7: ``machine.hooks.json_loads`` (the C scanner of ``_json`` without importing
    ``json``) gives what ``json.loads`` gives, for every recorded hook payload too."""
    import json

    from machine.hooks import json_loads

    data = data.read_bytes() if hasattr(data, "read_bytes") else data
    assert repr(json_loads(data)) == repr(json.loads(data))  # repr: NaN is not equal to itself


@pytest.mark.parametrize("data", _JSON_BAD_OR_ODD, ids=repr)
def test_i7_the_hooks_json_reader_answers_bad_or_odd_input_as_json_does(data):
    """Bad JSON, bad UTF-8, byte order marks: what ``json.loads`` does, its error included
    (then the hook logs one line and queues nothing, I1); it takes a UTF-8 BOM in bytes
    (it detects the encoding), and so does the reader."""
    import json

    from machine.hooks import json_loads

    try:
        expected = ("value", repr(json.loads(data)))
    except ValueError as error:
        expected = ("error", type(error), str(error))
    try:
        got = ("value", repr(json_loads(data)))
    except ValueError as error:
        got = ("error", type(error), str(error))
    assert got == expected
