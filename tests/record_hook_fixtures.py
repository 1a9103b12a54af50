"""Regenerates tests/fixtures/hooks/{codex,gemini,opencode}/ from the real agent CLIs
(SPEC I4, I7; issue 21).

    .venv/bin/python -m tests.record_hook_fixtures [codex gemini opencode]

Each CLI (installed by scripts/install_agent_clis.sh) gets RunStead's hooks exactly as
``install_hooks`` writes them (``machine.hooks.install``), with the hook command
swapped for tests/agents/record_hook.py, which records each payload; then it runs headless
and offline against the local fake of its model API (tests/model_apis.py), one turn with
a shell tool call (and, for opencode, one whose tool needs a permission it is refused;
for Gemini, one interactive under tmux whose approval dialog is allowed in the terminal,
for its ``Notification``).
The first payload of each event becomes ``<event>.json``, with what changes from run to
run made stable: the temporary HOME becomes ``/home/dev`` (the work folder
``/home/dev/project``), the run's session / thread id and Codex's turn id a fixed one of
the same form (``STABLE_IDS``), Gemini's timestamps (and transcript file names, the tool's process group) a fixed one.

Kept as written by hand, since no run here sends it: opencode's ``session_status_retry``
(a model API that asks to retry).
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from machine.hooks import install
from machine.protocol import HOOK_SCRIPT
from tests import model_apis
from tests.agent_clis import DEFAULT_BINS, offline, seed_opencode_plugin_deps
from tests.gemini_terminal import DIALOG, READY, gemini_terminal, submit, wait_closed
from tests.wait import wait_for

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "hooks"
RECORDER = Path(__file__).resolve().parent / "agents" / "record_hook.py"
APIS = {"codex": model_apis.ResponsesAPI, "gemini": model_apis.GeminiAPI, "opencode": model_apis.ChatAPI}
TOOL = "[[bash:echo hello > hello.txt]]"
STABLE_IDS = {
    "codex": ["0199a213-81c0-7800-8aa1-bbab2a035a53", "0199a213-8a14-7d21-9c3e-5b8f0e6d4c2a"],  # thread, turn
    "gemini": ["c25acda3-b3ba-4a3c-9fd0-5fdf1e5a6f41"],
    "opencode": ["ses_494719016ffe85dkDMj0FPRbHK"],
}
# recorded event name -> fixture name
NAMES = {
    "codex": {"agent-turn-complete": "notify_turn_complete", "SessionStart": "session_start",
              "UserPromptSubmit": "user_prompt_submit", "PreToolUse": "pre_tool_use",
              "PostToolUse": "post_tool_use", "Stop": "stop"},
    "gemini": {"SessionStart": "session_start", "BeforeAgent": "before_agent", "BeforeTool": "before_tool",
               "AfterTool": "after_tool", "AfterAgent": "after_agent", "SessionEnd": "session_end",
               "Notification": "notification_tool_permission"},
    "opencode": {"session.created": "session_created", "session.status:busy": "session_status_busy",
                 "session.status:idle": "session_status_idle", "session.idle": "session_idle",
                 "permission.asked": "permission_asked", "permission.replied": "permission_replied"},
}
CONFIG_DIRS = {"codex": ".codex", "gemini": ".gemini", "opencode": ".config/opencode"}


def install_recorder(name: str, home: Path, out: Path) -> None:
    """RunStead's hooks for ``name`` as ``install_hooks`` writes them, the command swapped
    for the recorder (``record_hook.py OUT AGENT``)."""
    config_dir = home / CONFIG_DIRS[name]
    install.install(name, server="http://127.0.0.1:9", token="record", config_dir=config_dir,
                    state_dir=home / ".runstead" / "hooks")
    for path in config_dir.rglob("*"):
        if path.is_file() and path.suffix in (".json", ".toml", ".js") and "node_modules" not in path.parts:
            text = path.read_text()
            script = str(install.PROJECT_ROOT.joinpath(*HOOK_SCRIPT))
            swapped = text.replace(f'"{script}", "{name}"', f'"{RECORDER}", "{out}", "{name}"')
            swapped = swapped.replace(f"{script} {name}", f"{RECORDER} {out} {name}")
            if swapped != text:
                path.write_text(swapped)
    if name == "opencode":
        seed_opencode_plugin_deps(config_dir)


def run(name: str, prompt: str, *, home: Path, work: Path, setup, extra_env: dict | None = None) -> None:
    env = {**setup.process_env({"GEMINI_CLI_TRUST_WORKSPACE": "true"} if name == "gemini" else None),
           "PWD": str(work), **(extra_env or {})}
    binary = str(DEFAULT_BINS[name])
    argv = {
        "codex": [binary, "exec", "--json", "--skip-git-repo-check", "--sandbox", "workspace-write",
                  "--dangerously-bypass-hook-trust", "--", prompt],
        "gemini": [binary, "--output-format", "stream-json", "--yolo", *setup.extra_args, f"--prompt={prompt}"],
        "opencode": [binary, "run", "--format", "json"],
    }[name]
    proc = subprocess.run(argv, cwd=work, env=env, input=prompt.encode() if name == "opencode" else b"",
                          capture_output=True, timeout=300)
    print(f"  {name}: {prompt!r} -> exit {proc.returncode}", file=sys.stderr)


def run_gemini_interactive(prompt: str, *, home: Path, work: Path, setup, out: Path) -> None:
    """Gemini CLI interactive (no ``--yolo``) in a tmux window: ``prompt`` asks for a shell
    call, the approval dialog (and its ``Notification``) shows, "Allow once", then
    ``/quit``. ``out``: the recorder's file (typing starts once its SessionStart hook ran)."""
    def starts() -> int:
        return out.read_text().count('"hook_event_name": "SessionStart"') if out.exists() else 0

    before = starts()
    with gemini_terminal(setup, home=home, work=work, socket=home / "tmux.sock") as term:
        term.wait_for(READY, timeout=90)
        wait_for(starts, until=lambda n: n != before, timeout_s=60, interval_s=0.1,
                 what="gemini's SessionStart hook to run")
        submit(term, prompt)
        term.wait_for(DIALOG, timeout=60)
        term.key("Enter")  # "1. Allow once"
        term.wait_for("done.", timeout=60)
        submit(term, "/quit")
        wait_closed(term)
    print(f"  gemini (interactive): {prompt!r}", file=sys.stderr)


def event_key(name: str, record: dict) -> tuple[str, dict]:
    """(the NAMES key, the payload) of one recorded hook call."""
    if record["argv"]:  # Codex notify: the JSON is the last argument
        payload = json.loads(record["argv"][-1])
        return payload["type"], payload
    payload = record["stdin"]
    if name == "opencode":
        status = (payload.get("properties") or {}).get("status") or {}
        key = f"{payload['type']}:{status.get('type')}" if payload["type"] == "session.status" else payload["type"]
        return key, payload
    return payload["hook_event_name"], payload


def stable(text: str, *, name: str, home: Path, ids: dict[str, str]) -> str:
    """``text`` with the run's HOME, ids (``ids``: found -> fixed) and times made stable."""
    text = text.replace(str(home.resolve()), "/home/dev").replace(str(home), "/home/dev")
    text = text.replace(str(home).lstrip("/"), "home/dev")  # opencode's relative `path`
    for found, fixed in ids.items():
        text = text.replace(found, fixed)
        if name == "gemini":  # its transcript file name holds the id's first 8 characters
            text = text.replace(f"-{found[:8]}.json", f"-{fixed[:8]}.json")
    if name == "gemini":  # its timestamps, and the start time in its transcript file names
        text = re.sub(r'"timestamp": "[^"]+"', '"timestamp": "2026-03-01T10:00:00.000Z"', text)
        text = re.sub(r"/session-\d{4}-\d\d-\d\dT\d\d-\d\d-", "/session-2026-03-01T10-00-", text)
        text = re.sub(r"Process Group PGID: \d+", "Process Group PGID: 26111", text)
    return text


def run_ids(name: str, payloads: list[dict]) -> dict[str, str]:
    """The runs' own ids -> their fixed ones (STABLE_IDS). opencode's two runs (two
    sessions) both become its one fixed session, so its fixtures read as one session."""
    found: list[str] = []
    for payload in payloads:
        if name == "codex" and payload.get("type") == "agent-turn-complete":
            return dict(zip([payload["thread-id"], payload["turn-id"]], STABLE_IDS[name]))
        session = payload.get("session_id") if name == "gemini" else (payload.get("properties") or {}).get("sessionID")
        if session and session not in found:
            found.append(session)
    if not found:
        raise SystemExit(f"{name}: no session id in the recorded payloads")
    return {session: STABLE_IDS[name][0] for session in found}


def record(name: str) -> None:
    print(f"recording {name}", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="hook-fixtures-") as tmp, APIS[name]() as api:
        home = Path(tmp)
        work = home / "project"
        work.mkdir()
        out = home / "payloads.jsonl"
        setup = offline(name, home, api)
        install_recorder(name, home, out)
        run(name, TOOL, home=home, work=work, setup=setup)
        chosen: dict[str, dict] = {}
        records = [json.loads(line) for line in out.read_text().splitlines()]
        if name == "opencode":  # a tool that asks: headless, opencode refuses it
            run(name, TOOL, home=home, work=work, setup=setup,
                extra_env={"OPENCODE_CONFIG_CONTENT": json.dumps({"permission": {"bash": "ask"}})})
            records = [json.loads(line) for line in out.read_text().splitlines()]
        if name == "gemini":  # the approval dialog's Notification: interactive only
            run_gemini_interactive(TOOL, home=home, work=work, setup=setup, out=out)
            records = [json.loads(line) for line in out.read_text().splitlines()]
        payloads = []
        for item in records:
            key, payload = event_key(name, item)
            payloads.append(payload)
            if key in NAMES[name] and NAMES[name][key] not in chosen:
                chosen[NAMES[name][key]] = payload
        ids = run_ids(name, payloads)
        missing = sorted(set(NAMES[name].values()) - set(chosen))
        if missing:
            print(f"  {name}: not sent in these runs: {', '.join(missing)}", file=sys.stderr)
        for fixture, payload in chosen.items():
            text = stable(json.dumps(payload, ensure_ascii=False), name=name, home=home, ids=ids)
            (FIXTURES / name / f"{fixture}.json").write_text(text + "\n")


def main(names: list[str]) -> None:
    for name in names or list(NAMES):
        record(name)


if __name__ == "__main__":
    main(sys.argv[1:])
