"""Stream parsers (SPEC G2, G3): each CLI's recorded stream gives the figures G2 keeps;
unknown events, non-JSON lines, truncated lines and interleaved garbage never fail; any
chunking gives the same answer; memory stays bounded on a 10 MB stream.

Fixtures (tests/fixtures/agents/) are captured from the real CLIs (Claude Code 2.1.328,
Codex 0.169.0, Gemini CLI 0.61.0, opencode 1.18.33, aider 0.86.2), each run as its preset
runs it against the local fake of its model API, by ``python -m
tests.record_agent_fixtures`` (which also derives ``claude_killed`` and ``claude_messy``
from the tool-call run). The expected figures follow the fakes' fixed answers
(tests/model_apis.py).
"""
import json
import random
import tracemalloc
from pathlib import Path

import pytest

from machine.protocol import ENTRY_CUT_MARK, ENTRY_TEXT_MAX_BYTES
from machine.worker.parsers import MAX_LINE_BYTES, MESSAGE_BYTES, PARSERS, cap, make_parser

pytestmark = pytest.mark.backend_independent  # neither database nor layer (pytest.ini)

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "agents"


def parse(name: str, fixture: str):
    parser = make_parser(name)
    parser.feed((FIXTURES / fixture).read_bytes())
    parser.close()
    return parser


def usage(turns, tool_calls, input_tokens, output_tokens, cost_usd):
    return {"turns": turns, "tool_calls": tool_calls, "input_tokens": input_tokens, "output_tokens": output_tokens,
            "cost_usd": cost_usd}


CLAUDE_OK = {
    "agent_session_id": "b6e66952-929c-4f1e-a0e0-91664c71fa14",
    "agent_result": {"is_error": False, "subtype": "success", "summary": "done."},
    "usage": usage(2, 1, 24, 14, 0.000376),
    "last_message": "done.",
}
CODEX_ID = "0199a213-81c0-7800-8aa1-bbab2a035a53"
FAKE_REFUSAL = '{"error": {"type": "invalid_request_error", "code": "fake_refusal", "message": "fake refusal", ' \
               '"param": null}}'

CASES = [
    ("claude", "claude_tool_call.jsonl", CLAUDE_OK),
    ("claude", "claude_api_error.jsonl", {
        "agent_session_id": "b6e66952-929c-4f1e-a0e0-91664c71fa14",
        # The CLI says subtype "success" with is_error true: the parser names the cause.
        "agent_result": {"is_error": True, "subtype": "api_error", "summary": "API Error: 400 fake refusal"},
        "usage": usage(1, 0, 0, 0, 0.0),
        "last_message": "API Error: 400 fake refusal",
    }),
    ("claude", "claude_messy.jsonl", CLAUDE_OK),
    ("claude", "claude_killed.jsonl", {
        "agent_session_id": "b6e66952-929c-4f1e-a0e0-91664c71fa14",
        "agent_result": None,  # killed before its result: no verdict, the exit status judges
        "usage": usage(1, 1, 12, 1, None),
        "last_message": "Running it.",
    }),
    ("codex", "codex_exec.jsonl", {
        "agent_session_id": CODEX_ID,
        "agent_result": {"is_error": False, "subtype": "completed", "summary": "done."},
        "usage": usage(1, 1, 40, 10, None),  # two model calls of 20 + 5 tokens
        "last_message": "done.",
    }),
    ("codex", "codex_resume.jsonl", {
        "agent_session_id": CODEX_ID,
        "agent_result": {"is_error": False, "subtype": "completed", "summary": "ok: and the docs"},
        # One model call (20 + 5) but Codex reports the thread's total, the first run's too.
        "usage": usage(1, 0, 60, 15, None),
        "last_message": "ok: and the docs",
    }),
    ("codex", "codex_turn_failed.jsonl", {
        "agent_session_id": CODEX_ID,
        "agent_result": {"is_error": True, "subtype": "turn_failed", "summary": FAKE_REFUSAL},
        "usage": usage(1, 0, None, None, None),
        "last_message": None,
    }),
    ("gemini", "gemini_stream.jsonl", {
        "agent_session_id": "c25acda3-b3ba-4a3c-9fd0-5fdf1e5a6f41",
        "agent_result": {"is_error": False, "subtype": "success", "summary": "done."},
        "usage": usage(1, 1, 60, 12, None),
        "last_message": "done.",
    }),
    ("gemini", "gemini_error.jsonl", {
        "agent_session_id": "c25acda3-b3ba-4a3c-9fd0-5fdf1e5a6f41",
        "agent_result": {"is_error": True, "subtype": "api_error", "summary":
                         '[API Error: {"error":{"code":400,"message":"fake refusal","status":"INVALID_ARGUMENT"}}]'},
        "usage": usage(0, 0, 0, 0, None),
        "last_message": None,
    }),
    ("opencode", "opencode_run.jsonl", {
        "agent_session_id": "ses_494719016ffe85dkDMj0FPRbHK",
        "agent_result": {"is_error": False, "subtype": "stop", "summary": "done."},
        # two steps of 40 + 8 tokens at $3 / $15 per million
        "usage": usage(2, 1, 80, 16, 0.00048),
        "last_message": "done.",
    }),
    ("opencode", "opencode_error.jsonl", {
        "agent_session_id": "ses_494719016ffe85dkDMj0FPRbHK",
        "agent_result": {"is_error": True, "subtype": "APIError", "summary": "fake refusal"},
        "usage": usage(0, 0, None, None, None),
        "last_message": None,
    }),
    ("aider", "aider.txt", {  # the text alone, as while it runs: no verdict yet
        "agent_session_id": None,
        "agent_result": None,
        "usage": usage(1, None, 593, 4, 0.0018),
        "last_message": "ok: say hi",
    }),
]
# aider's verdict is in its run record (--analytics-log), read when it ended.
RECORD_CASES = [
    ("aider.txt", "aider_record.jsonl", {
        "agent_session_id": None,
        "agent_result": {"is_error": False, "subtype": "success", "summary": "ok: say hi"},
        "usage": usage(1, None, 593, 4, 0.001839),
        "last_message": "ok: say hi",
    }),
    ("aider_error.txt", "aider_error_record.jsonl", {  # exit 0, yet it failed (G3)
        "agent_session_id": None,
        "agent_result": {"is_error": True, "subtype": "api_error",
                         "summary": "litellm.BadRequestError: OpenAIException - fake refusal"},
        "usage": usage(0, None, None, None, None),
        "last_message": "litellm.BadRequestError: OpenAIException - fake refusal",
    }),
]


@pytest.mark.parametrize("output,record,expected", RECORD_CASES, ids=[c[1] for c in RECORD_CASES])
def test_g3_aider_verdict_from_its_analytics_log(output, record, expected):
    parser = parse("aider", output)
    parser.feed_record((FIXTURES / record).read_bytes())
    assert parser.facts() == expected


def test_g3_aider_record_without_an_answer_or_a_send_is_an_error():
    parser = make_parser("aider")
    parser.feed_record(b'{"event": "launched"}\nnot json\n{"event": "exit", "properties": {"reason": "x"}}\n')
    assert parser.facts()["agent_result"]["subtype"] == "nothing_sent"
    killed = make_parser("aider")  # no exit event: no verdict, the exit status judges
    killed.feed_record(b'{"event": "message_send_starting"}\n{"event": "message_send", "properties": {}}\n')
    assert killed.facts()["agent_result"] is None


def test_g2_aider_token_line_units():
    """Larger runs print k/M units and cache notes (aider's own format)."""
    parser = make_parser("aider")
    parser.feed_line("Tokens: 4.2k sent, 1.1k cache write, 210 received. Cost: $0.02 message, $0.02 session.")
    parser.feed_line("Tokens: 1.5M sent, 3.9k cache hit, 95 received. Cost: $0.0061 message, $4.03 session.")
    assert parser.facts()["usage"] == usage(2, None, 4200 + 1_500_000, 305, 4.03)


@pytest.mark.parametrize("name,fixture,expected", CASES, ids=[c[1] for c in CASES])
def test_g2_parser_reads_recorded_stream(name, fixture, expected):
    assert parse(name, fixture).facts() == expected


@pytest.mark.parametrize("name,fixture,expected", CASES, ids=[c[1] for c in CASES])
def test_g2_any_chunking_gives_the_same_facts(name, fixture, expected):
    data = (FIXTURES / fixture).read_bytes()
    rng = random.Random(fixture)
    parser = make_parser(name)
    i = 0
    while i < len(data):
        n = rng.choice([1, 2, 3, 7, 64, 500])
        parser.feed(data[i:i + n])  # splits lines and multi-byte characters anywhere
        i += n
    parser.close()
    assert parser.facts() == expected


def test_g2_garbage_is_kept_as_text_and_counted():
    parser = parse("claude", "claude_messy.jsonl")
    # npm warning, blank, half a line, [1,2,3], '{"not json', ANSI warning
    assert parser.text_lines == 6
    # rate_limit_event, brand_new_event_2027, an assistant event whose message is a string
    assert parser.unknown_events == 3


def test_g2_plain_text_parser_keeps_nothing_structured():
    parser = make_parser("text")
    parser.feed(b"hello\n{\"type\":\"result\",\"is_error\":true}\n")
    parser.close()
    assert parser.facts() == {"agent_session_id": None, "agent_result": None, "usage": None, "last_message": None}


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_g2_random_bytes_never_raise(name):
    rng = random.Random(name)
    parser = make_parser(name)
    for _ in range(300):
        blob = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
        parser.feed(blob + rng.choice([b"\n", b"", b"\r\n"]))
        parser.feed_line(rng.choice(['{"type":"result","usage":[]}', '{"type":"assistant","message":{"content":7}}',
                                     '{"type":"item.completed","item":null}', '{"type":"step_finish","part":"x"}',
                                     '{"type":"message","role":"assistant","content":null}', "{}", "null"]))
    parser.close()
    json.dumps(parser.facts())  # always serialisable


def test_g2_last_message_is_capped_at_4_kib_on_a_character_boundary():
    parser = make_parser("claude")
    text = "é" * 5000  # 10000 bytes
    parser.feed_line(json.dumps({"type": "assistant", "message": {"id": "m1", "content": [{"type": "text",
                                                                                           "text": text}]}}))
    message = parser.facts()["last_message"]
    assert len(message.encode()) <= MESSAGE_BYTES and message == "é" * (MESSAGE_BYTES // 2)
    # Gemini deltas append up to the cap and no further
    gemini = make_parser("gemini")
    for _ in range(3000):
        gemini.feed_line(json.dumps({"type": "message", "role": "assistant", "content": "abc", "delta": True}))
    assert len(gemini.facts()["last_message"].encode()) == MESSAGE_BYTES
    assert cap("ab", 1) == "a"


def test_g4_version_rises_only_on_change():
    parser = make_parser("claude")
    parser.feed_line("plain text")
    assert parser.version == 0
    parser.feed_line('{"type":"system","subtype":"init","session_id":"s1"}')
    first = parser.version
    assert first == 1
    parser.feed_line('{"type":"system","subtype":"hook_response"}')
    assert parser.version == first
    parser.feed_line(json.dumps({"type": "assistant", "message": {"id": "m1", "content": [
        {"type": "tool_use", "id": "t1", "name": "Bash", "input": {}}]}}))
    assert parser.version == first + 1
    assert parser.progress() == {"last_message": None, "usage": usage(1, 1, None, None, None)}


def test_g2_claude_counts_one_turn_per_message_id_and_each_tool_once():
    parser = make_parser("claude")
    for block in ({"type": "text", "text": "Let me look."}, {"type": "tool_use", "id": "t1"},
                  {"type": "tool_use", "id": "t2"}):
        parser.feed_line(json.dumps({"type": "assistant", "message": {
            "id": "m1", "content": [block], "usage": {"input_tokens": 5, "cache_read_input_tokens": 100,
                                                      "output_tokens": 9}}}))
    parser.feed_line(json.dumps({"type": "assistant", "message": {"id": "m2", "content": [
        {"type": "text", "text": "Done."}], "usage": {"input_tokens": 7, "output_tokens": 3}}}))
    assert parser.progress() == {"last_message": "Done.", "usage": usage(2, 2, 112, 12, None)}


def test_g2_claude_last_result_wins_after_a_wake_turn():
    """With a background task, -p waits and runs a wake turn: a second result line."""
    parser = make_parser("claude")
    parser.feed_line('{"type":"result","subtype":"success","is_error":false,"session_id":"s","num_turns":1,'
                     '"total_cost_usd":0.1,"result":"first"}')
    parser.feed_line('{"type":"result","subtype":"error_during_execution","is_error":true,"session_id":"s",'
                     '"num_turns":2,"total_cost_usd":0.2,"errors":["tool crashed"]}')
    facts = parser.facts()
    assert facts["agent_result"] == {"is_error": True, "subtype": "error_during_execution", "summary": "tool crashed"}
    # num_turns is per turn and adds up; total_cost_usd counts the whole process (G2).
    assert facts["usage"]["turns"] == 3 and facts["usage"]["cost_usd"] == 0.2


def test_g2_overlong_line_is_skipped_whole():
    parser = make_parser("claude")
    parser.feed(b'{"type":"system","subtype":"init","session_id":"s1"}\n')
    parser.feed(b'{"type":"result","is_error":true,"result":"' + b"x" * (MAX_LINE_BYTES + 10))
    parser.feed(b'"}\n{"type":"result","subtype":"success","is_error":false,"num_turns":3}\n')
    parser.close()
    assert parser.facts()["agent_result"] == {"is_error": False, "subtype": "success", "summary": ""}
    assert parser.text_lines == 1


def test_g2_ten_megabyte_stream_keeps_memory_bounded():
    """A fast, long stream: ~10 MB of assistant/tool events plus one 3 MB line. The parser
    holds no events: its peak allocation stays a small multiple of one line's bound."""
    parser = make_parser("claude")
    event = json.dumps({"type": "assistant", "message": {"id": "mid{}", "content": [
        {"type": "text", "text": "x" * 800}, {"type": "tool_use", "id": "tid{}", "name": "Bash", "input": {}}],
        "usage": {"input_tokens": 1, "output_tokens": 1}}}) + "\n"
    chunk = "".join(event.replace("mid{}", f"mid{i}").replace("tid{}", f"tid{i}") for i in range(100)).encode()
    garbage = memoryview(b"A" * (3 * 1024 * 1024) + b"\n")  # one enormous non-JSON line
    tracemalloc.start()
    try:
        fed = 0
        n = 0
        while fed < 10 * 1024 * 1024:
            parser.feed(chunk.replace(b'"mid', b'"mid%d_' % n).replace(b'"tid', b'"tid%d_' % n))
            fed += len(chunk)
            n += 1
            if n == 50:
                for i in range(0, len(garbage), 65536):  # as the worker reads it: 64 KiB at a time
                    parser.feed(bytes(garbage[i:i + 65536]))
        parser.feed(b'{"type":"result","subtype":"success","is_error":false,"num_turns":7,"total_cost_usd":1.5}\n')
        parser.close()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    facts = parser.facts()
    assert fed >= 10 * 1024 * 1024
    assert peak < 3 * MAX_LINE_BYTES, f"peak {peak} bytes"
    assert facts["usage"]["turns"] == 7 and facts["usage"]["tool_calls"] == n * 100
    assert facts["agent_result"]["subtype"] == "success"
    assert len(facts["last_message"].encode()) <= MESSAGE_BYTES


# --- G4: transcript entries -------------------------------------------------------------------

TOOL = "[[bash:echo hello > hello.txt]]"  # the prompts tests/record_agent_fixtures.py ran
ERROR = "[[error:400]]"
CODEX_WARNING = ("Model metadata for `gpt-test` not found. Defaulting to fallback metadata; this can degrade "
                 "performance and cause issues.")
ENTRY_CASES = [
    ("claude", "claude_tool_call.jsonl", TOOL, [
        {"n": 1, "kind": "prompt", "text": TOOL},
        {"n": 2, "kind": "message", "text": "Running it.", "usage": {"input_tokens": 12, "output_tokens": 1}},
        {"n": 3, "kind": "tool_call", "text": "echo hello > hello.txt", "tool": "Bash"},
        {"n": 4, "kind": "tool_result", "text": "(Bash completed with no output)", "tool": "Bash", "status": "ok",
         "call": 3},
        {"n": 5, "kind": "message", "text": "done.", "usage": {"input_tokens": 12, "output_tokens": 1}},
    ]),
    ("claude", "claude_api_error.jsonl", ERROR, [
        {"n": 1, "kind": "prompt", "text": ERROR},
        {"n": 2, "kind": "message", "text": "API Error: 400 fake refusal", "usage": {"input_tokens": 0, "output_tokens": 0}},
        {"n": 3, "kind": "error", "text": "API Error: 400 fake refusal"},
    ]),
    ("codex", "codex_exec.jsonl", TOOL, [
        {"n": 1, "kind": "prompt", "text": TOOL},
        {"n": 2, "kind": "error", "text": CODEX_WARNING},
        {"n": 3, "kind": "tool_call", "text": "/bin/bash -lc 'echo hello > hello.txt'", "tool": "shell"},
        {"n": 4, "kind": "tool_result", "text": "", "tool": "shell", "status": "ok", "call": 3},
        {"n": 5, "kind": "message", "text": "done.", "usage": {"input_tokens": 40, "output_tokens": 10}},
    ]),
    ("codex", "codex_turn_failed.jsonl", ERROR, [
        {"n": 1, "kind": "prompt", "text": ERROR},
        {"n": 2, "kind": "error", "text": CODEX_WARNING},
        {"n": 3, "kind": "error", "text": FAKE_REFUSAL},  # the `error` event
        {"n": 4, "kind": "error", "text": FAKE_REFUSAL},  # and turn.failed
    ]),
    ("gemini", "gemini_stream.jsonl", TOOL, [
        {"n": 1, "kind": "prompt", "text": TOOL},  # the stream's echo of the prompt is not kept twice
        {"n": 2, "kind": "tool_call", "text": "echo hello > hello.txt", "tool": "run_shell_command"},
        {"n": 3, "kind": "tool_result", "text": "", "tool": "run_shell_command", "status": "ok", "call": 2},
        {"n": 4, "kind": "message", "text": "done."},
    ]),
    ("gemini", "gemini_error.jsonl", ERROR, [
        {"n": 1, "kind": "prompt", "text": ERROR},
        {"n": 2, "kind": "error", "text":
         '[API Error: {"error":{"code":400,"message":"fake refusal","status":"INVALID_ARGUMENT"}}]'},
    ]),
    ("opencode", "opencode_run.jsonl", TOOL, [
        {"n": 1, "kind": "prompt", "text": TOOL},
        {"n": 2, "kind": "tool_call", "text": "echo hello > hello.txt", "tool": "bash"},
        {"n": 3, "kind": "tool_result", "text": "(no output)", "tool": "bash", "status": "ok", "call": 2},
        {"n": 4, "kind": "message", "text": "done.", "usage": {"input_tokens": 40, "output_tokens": 8}},
    ]),
    ("opencode", "opencode_error.jsonl", ERROR, [{"n": 1, "kind": "prompt", "text": ERROR},
                                                 {"n": 2, "kind": "error", "text": "fake refusal"}]),
    ("aider", "aider.txt", "say hi", []),  # plain text: no transcript, the raw output is the run
]


@pytest.mark.parametrize("name,fixture,prompt,expected", ENTRY_CASES, ids=[c[1] for c in ENTRY_CASES])
def test_g4_recorded_streams_become_transcript_entries(name, fixture, prompt, expected):
    parser = make_parser(name, prompt)
    data = (FIXTURES / fixture).read_bytes()
    rng = random.Random(fixture)
    i = 0
    while i < len(data):  # any chunking: the same entries
        n = rng.choice([1, 5, 64, 4096])
        parser.feed(data[i:i + n])
        i += n
    parser.close()
    assert list(parser.entries) == expected
    assert parser.entries_since(2) == expected[2:]


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_g4_every_entry_passes_the_services_validation(name):
    """What the parsers make on garbage and on every fixture is what the service accepts."""
    from tasks_app.agent_facts import clean_entries

    rng = random.Random("entries" + name)
    parser = make_parser(name, "p\x00rompt")
    for fixture in sorted(FIXTURES.iterdir()):
        parser.feed(fixture.read_bytes())
    for _ in range(200):
        parser.feed(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 100))) + b"\n")
        parser.feed_line(json.dumps({"type": "assistant", "message": {"id": str(rng.random()), "content": [
            {"type": "text", "text": "\ud800 é\x00" * rng.randrange(2000)},
            {"type": "tool_use", "id": "t", "name": "N" * 300, "input": {"command": ["ls", "-l"]}}]}}))
    parser.close()
    entries = list(parser.entries)
    for start in range(0, len(entries), 50):
        clean_entries(entries[start:start + 50])
    assert [e["n"] for e in entries] == sorted({e["n"] for e in entries})


def test_g4_a_long_entry_is_cut_to_2_kib_and_marked():
    parser = make_parser("claude", "p")
    parser.feed_line(json.dumps({"type": "assistant", "message": {"id": "m", "content": [
        {"type": "text", "text": "line one\nline two\n" + "é" * 3000}]}}))
    text = parser.entries[-1]["text"]
    assert text.startswith("line one\nline two\n") and text.endswith(ENTRY_CUT_MARK)
    assert len(text.encode()) <= ENTRY_TEXT_MAX_BYTES


def test_g4_a_gemini_message_streamed_in_deltas_is_one_entry_when_it_ends():
    parser = make_parser("gemini")
    for part in ("Hel", "lo", " world"):
        parser.feed_line(json.dumps({"type": "message", "role": "assistant", "content": part, "delta": True}))
    assert list(parser.entries) == []  # still growing
    parser.close()  # the stream ended mid-message: it is kept
    assert list(parser.entries) == [{"n": 1, "kind": "message", "text": "Hello world"}]


STREAM_INPUT = Path(__file__).resolve().parent / "fixtures" / "claude_stream_input"


@pytest.mark.parametrize("fixture,expected", [
    # Three turns in one process (2.1.328, tests/record_claude_stream_input.py): each
    # `result` says num_turns 1 and usage 12 in / 7 out for its own turn, while
    # total_cost_usd counts the whole process (0.000188, 0.000376, 0.000564).
    ("two_turns.jsonl", usage(3, 0, 36, 21, 0.000564)),
    # An interrupted turn (num_turns 3, a tool call) then an answered one.
    ("interrupt.jsonl", usage(4, 1, 24, 14, 0.000376)),
])
def test_g2_c1_claude_usage_adds_up_over_every_turn_of_a_conversation(fixture, expected):
    data = (STREAM_INPUT / fixture).read_bytes()
    parser = make_parser("claude", "first")
    parser.feed(data)
    parser.close()
    assert parser.facts()["usage"] == expected
    # Live progress while the turns go by never goes down.
    parser, seen = make_parser("claude"), []
    for line in data.splitlines(keepends=True):
        parser.feed(line)
        seen.append(parser.usage() or usage(0, 0, 0, 0, 0))
    for key in ("turns", "input_tokens", "output_tokens"):
        counts = [u[key] or 0 for u in seen]
        assert counts == sorted(counts), (key, counts)


def test_g2_c1_a_turn_without_figures_in_its_result_counts_its_messages():
    parser = make_parser("claude")
    for n in (1, 2):
        parser.feed_line(json.dumps({"type": "assistant", "message": {"id": f"m{n}", "content": [
            {"type": "text", "text": f"answer {n}"}], "usage": {"input_tokens": 10, "output_tokens": 2}}}))
        parser.feed_line(json.dumps({"type": "result", "subtype": "success", "is_error": False,
                                     "result": f"answer {n}"}))
    assert parser.usage() == usage(2, 0, 20, 4, None)


def test_g4_c2_each_turn_of_a_live_conversation_opens_with_its_message_prompt_entry_and_seq():
    """Three recorded turns (2.1.328), the messages handed as the conversation part hands
    them (before the agent reads them): each turn's entries follow its own prompt entry,
    which carries the message's seq; a re-parse with the same messages numbers it alike."""
    data = (STREAM_INPUT / "two_turns.jsonl").read_bytes()

    def parse(chunks):
        parser = make_parser("claude")
        for seq, text in enumerate(["first", "second", "third"]):
            parser.turn_prompt(seq, text)
        for chunk in chunks:
            parser.feed(chunk)
        parser.close()
        return list(parser.entries)

    entries = parse(data.splitlines(keepends=True))
    prompts = [e for e in entries if e["kind"] == "prompt"]
    assert [(e["seq"], e["text"]) for e in prompts] == [(0, "first"), (1, "second"), (2, "third")]
    assert entries[0] == {"n": 1, "kind": "prompt", "text": "first", "seq": 0}
    # Between two prompts, the earlier message's turn: at least one reply entry each.
    at = [entries.index(p) for p in prompts] + [len(entries)]
    assert all(b - a > 1 for a, b in zip(at, at[1:])), entries
    assert parse([data]) == entries  # X3: the same numbering from one read


def test_g4_c2_a_turn_that_made_no_entry_still_shows_its_prompt_before_its_end():
    parser = make_parser("claude")
    parser.turn_prompt(0, "hello")
    parser.feed_line(json.dumps({"type": "result", "subtype": "success", "is_error": False, "result": ""}))
    parser.turn_prompt(1, "again")
    # Claude Code echoing the message first (--replay-user-messages) adds no second prompt entry.
    parser.feed_line(json.dumps({"type": "user", "message": {"role": "user", "content": "again"}}))
    parser.feed_line(json.dumps({"type": "assistant", "message": {"id": "m1", "content": [
        {"type": "text", "text": "hi"}]}}))
    assert [(e["kind"], e["text"], e.get("seq")) for e in parser.entries] == [
        ("prompt", "hello", 0), ("prompt", "again", 1), ("message", "hi", None)]
