"""SPEC I2-I4, I6: each CLI's recorded hook payloads mapped to the writes they imply
(pure functions, no service). The live board sequences are in test_hooks_live.py."""
import uuid

import pytest

from sessions_app.hooks import RUNSTEAD_NAMESPACE, mapping
from tests.hooks_support import fixture

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
    assert RUNSTEAD_NAMESPACE == uuid.UUID("80bf71b1-6975-58ca-9896-94d5739ee39a")
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


def test_i4_codex_notify_writes_running_then_ended_for_a_turn_never_started():
    state = {}
    writes = call("codex", fixture("codex", "notify_turn_complete"), state)
    assert kinds(writes) == ["create", "running:12345", "ended:12345"]
    assert writes[0]["body"]["title"] == "Rename `foo` to `bar` and update the callsites."
    assert writes[0]["body"]["id"] == str(uuid.uuid5(RUNSTEAD_NAMESPACE, "codex:b5f6c1e2-3d4a-4b5c-8d9e-0f1a2b3c4d5e"))
    assert call("codex", fixture("codex", "notify_turn_complete"), state) == []  # a repeat adds nothing


def test_i4_codex_hooks_then_notify_end_the_turn_once():
    state = {}
    assert kinds(call("codex", fixture("codex", "session_start"), state)) == ["create", "sweep"]
    assert kinds(call("codex", fixture("codex", "user_prompt_submit"), state)) == ["running:12345", "title"]
    assert kinds(call("codex", fixture("codex", "stop"), state)) == ["ended:12345"]
    assert call("codex", fixture("codex", "notify_turn_complete"), state) == []


def test_i4_codex_notify_ends_a_turn_its_prompt_hook_started():
    state = {}
    call("codex", fixture("codex", "user_prompt_submit"), state)
    assert kinds(call("codex", fixture("codex", "notify_turn_complete"), state)) == ["ended:12345"]


def test_i4_gemini_before_after_agent_and_tool_permission():
    state = {}
    assert kinds(call("gemini", fixture("gemini", "session_start"), state)) == ["create", "sweep"]
    writes = call("gemini", fixture("gemini", "before_agent"), state)
    turn = state["turn"]
    assert kinds(writes) == [f"running:{turn}", "title"]
    assert kinds(call("gemini", fixture("gemini", "notification_tool_permission"), state)) == ["attention"]
    assert kinds(call("gemini", fixture("gemini", "after_agent"), state)) == ["clear", f"ended:{turn}"]
    assert kinds(call("gemini", fixture("gemini", "session_end"), state)) == []


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


@pytest.mark.parametrize("agent,payload,message", [
    ("claude", [], "not a JSON object"),
    ("claude", {"hook_event_name": "Stop"}, "no session id"),
    ("claude", {"session_id": "s", "hook_event_name": "PreToolUse"}, "unknown event"),
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
