"""Regenerates tests/fixtures/agents/ from the real agent CLIs (SPEC G2; issue 21).

    .venv/bin/python -m tests.record_agent_fixtures [claude codex gemini opencode aider]

Each CLI (installed by scripts/install_agent_clis.sh) runs offline exactly as the worker
runs it (its preset's argv and env, machine/worker/presets.py; stdout and stderr in one
stream, as the worker's output file has them) against the local fake of its model API
(tests/model_apis.py), once per scenario below. The captured lines are written with
three things made stable, so that a new recording changes only what the CLI changed:
the temporary HOME becomes ``/home/dev`` (the work folder ``/home/dev/project``), the
installed CLIs' folder ``/opt/agent-clis``, and each run's session / thread id becomes a
fixed one of the same form (``SESSION_IDS``).
Derived files are made from the recordings: ``claude_killed`` (the tool-call run cut
before its result, the last line half written) and ``claude_messy`` (it with garbage
lines interleaved). The expectations in tests/test_agent_parsers.py follow the fake's
fixed answers; a new CLI version that changes a figure shows there.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from machine.worker.config import parse_profile
from machine.worker.presets import PRESETS
from tests import model_apis
from tests.agent_clis import CLI_DIR, DEFAULT_BINS, offline

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "agents"
APIS = {"claude": model_apis.AnthropicAPI, "codex": model_apis.ResponsesAPI, "gemini": model_apis.GeminiAPI,
        "opencode": model_apis.ChatAPI, "aider": model_apis.ChatAPI}
TOOL = "[[bash:echo hello > hello.txt]]"
ERROR = "[[error:400]]"
# fixture name -> (prompt, resume the previous scenario's session?)
SCENARIOS = {
    "claude": {"claude_tool_call": (TOOL, False), "claude_api_error": (ERROR, False)},
    "codex": {"codex_exec": (TOOL, False), "codex_resume": ("and the docs", True),
              "codex_turn_failed": (ERROR, False)},
    "gemini": {"gemini_stream": (TOOL, False), "gemini_error": (ERROR, False)},
    "opencode": {"opencode_run": (TOOL, False), "opencode_error": (ERROR, False)},
    "aider": {"aider": ("say hi", False), "aider_error": (ERROR, False)},
}
SESSION_IDS = {
    "claude": "b6e66952-929c-4f1e-a0e0-91664c71fa14",
    "codex": "0199a213-81c0-7800-8aa1-bbab2a035a53",
    "gemini": "c25acda3-b3ba-4a3c-9fd0-5fdf1e5a6f41",
    "opencode": "ses_494719016ffe85dkDMj0FPRbHK",
}
SESSION_KEYS = {"claude": "session_id", "codex": "thread_id", "gemini": "session_id", "opencode": "sessionID"}
GARBAGE = [  # (insert before line n of the recording, text): what a messy stream carries
    (0, "npm WARN config production Use `--omit=dev` instead."),
    (1, '{"type":"rate_limit_event","rate_limit_info":{"status":"allowed","resetsAt":1767225600}}'),
    (1, ""),
    (2, "[1, 2, 3]"),
    (3, '{"not json at all'),
    (3, '{"type":"assistant","message":{"id":"msg'),  # half a line
    (3, "\x1b[31mSome ANSI-coloured warning\x1b[0m"),
    (4, '{"type":"assistant","message":"a string where an object belongs"}'),
    (5, '{"type":"brand_new_event_2027","payload":{"x":1}}'),
]


def session_of(name: str, lines: list[str]) -> str | None:
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and isinstance(event.get(SESSION_KEYS.get(name, "")), str):
            return event[SESSION_KEYS[name]]
    return None


def run(name: str, prompt: str, *, home: Path, work: Path, api, session: str | None) -> tuple[list[str], str | None]:
    """One run as the worker makes it: (merged output lines, the run's session id)."""
    setup = offline(name, home, api)
    profile = parse_profile(name, {"preset": name, "binary": str(DEFAULT_BINS[name]), "extra_args": setup.extra_args})
    op_dir = Path(tempfile.mkdtemp(prefix="op-", dir=home))
    argv = profile.command(prompt=prompt, folder=str(work), agent_session_id=session, op_dir=str(op_dir))
    stdin = prompt.encode() if profile.prompt_via == "stdin" else b""
    env = {**setup.process_env(PRESETS[name].env), "PWD": str(work)}  # as the worker's spawn sets it
    proc = subprocess.run(argv, cwd=work, env=env, input=stdin,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
    lines = proc.stdout.decode(errors="replace").splitlines()
    record = profile.record_path(str(op_dir))
    if record and os.path.exists(record):
        lines = lines + ["#record"] + Path(record).read_text().splitlines()
    print(f"  {name}: {prompt!r} -> exit {proc.returncode}, {len(lines)} lines", file=sys.stderr)
    return lines, session_of(name, lines)


def normalise(text: str, *, home: Path, session: str | None, name: str) -> str:
    text = text.replace(str(home.resolve()), "/home/dev").replace(str(home), "/home/dev")
    text = text.replace(str(CLI_DIR.resolve()), "/opt/agent-clis").replace(str(CLI_DIR), "/opt/agent-clis")
    if session and name in SESSION_IDS:
        text = text.replace(session, SESSION_IDS[name])
    return re.sub(r"/home/dev/work\b", "/home/dev/project", text)


def write(fixture: str, lines: list[str]) -> None:
    """``<fixture>.jsonl`` (``.txt`` for aider's text); a run record after ``#record``
    goes to ``<fixture>_record.jsonl``."""
    if "#record" in lines:
        at = lines.index("#record")
        lines, record = lines[:at], lines[at + 1:]
        (FIXTURES / f"{fixture}_record.jsonl").write_text("\n".join(record) + "\n")
    suffix = ".txt" if fixture.startswith("aider") else ".jsonl"
    (FIXTURES / f"{fixture}{suffix}").write_text("\n".join(lines) + "\n")


def record(name: str) -> None:
    print(f"recording {name}", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="fixtures-") as tmp, APIS[name]() as api:
        home = Path(tmp)
        work = home / "work"
        work.mkdir()
        previous = None
        for fixture, (prompt, resume) in SCENARIOS[name].items():
            lines, session = run(name, prompt, home=home, work=work, api=api, session=previous if resume else None)
            previous = session or previous
            text = normalise("\n".join(lines), home=home, session=session, name=name)
            write(fixture, text.splitlines())
    if name == "claude":
        derive_claude()


def derive_claude() -> None:
    lines = (FIXTURES / "claude_tool_call.jsonl").read_text().splitlines()
    events = [json.loads(line) if line.startswith("{") else {} for line in lines]
    first_result = next(i for i, e in enumerate(events) if e.get("type") == "user")
    killed = lines[:first_result] + [lines[first_result + 1][:40]]
    (FIXTURES / "claude_killed.jsonl").write_text("\n".join(killed))  # no newline: cut mid-line
    messy = list(lines)
    for offset, (before, text) in enumerate(GARBAGE):
        messy.insert(before + offset, text)
    (FIXTURES / "claude_messy.jsonl").write_text("\n".join(messy) + "\n")


def main(names: list[str]) -> None:
    for name in names or list(SCENARIOS):
        record(name)


if __name__ == "__main__":
    main(sys.argv[1:])
