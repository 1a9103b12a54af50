#!/usr/bin/env python3
"""A stand-in for Claude Code in headless mode, for the demo and the end-to-end tests
(SPEC G, O1): no vendor account, no network. It takes Claude Code's arguments
(``-p [PROMPT] --output-format stream-json --verbose [--resume ID] [--] [PROMPT]``; the
prompt from stdin when none is given) and speaks its stream-json: ``system/init`` with a
session id, ``assistant`` turns with a ``Bash`` tool call, the ``user`` tool result, and
a final ``result`` with usage and cost. The tool call is real: in a git work tree it
appends the prompt to ``NOTES.md`` and commits it, so the task shows git evidence.

Environment (all optional):
- ``FAKE_CLAUDE_PAUSE_S`` (default 1.5): pause between events, so progress can be watched;
- ``FAKE_CLAUDE_TURNS`` (default 3): assistant turns, the middle ones each make a tool call;
- ``FAKE_CLAUDE_RESULT``: ``success`` (default), ``api_error`` (an API error reported
  with ``is_error: true`` and exit 0, as some versions do) or ``max_turns``;
- ``FAKE_CLAUDE_EXIT`` (default 0): the exit code;
- ``FAKE_CLAUDE_RECORD``: a file; one JSON line ``{"argv", "stdin", "cwd"}`` is appended per run;
- ``FAKE_CLAUDE_COMMIT`` (default 1): 0 makes the tool call read-only (``git status``);
- ``FAKE_CLAUDE_SLOW_PROMPT``: after the tool call of a conversation message containing
  this text, the pause is ``FAKE_CLAUDE_SLOW_PAUSE_S`` (default 30), so a test can stop
  the turn while its tool call shows.
Standard library only.
"""
import json
import os
import queue
import subprocess
import sys
import threading
import time
import uuid

PRICE_IN = 3e-6
PRICE_OUT = 15e-6
# Like Claude Code 2.1.328 (docs/claude-stream-input.md): a result's num_turns and usage are
# its turn's own, its total_cost_usd counts every turn of the process so far.
spent = [0.0]


def emit(event: dict) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def parse_args(argv: list[str]) -> tuple[str | None, str | None]:
    prompt, resume, i = None, None, 0
    takes_value = {"--output-format", "--input-format", "--permission-mode", "--max-turns", "--model",
                   "--allowedTools", "--disallowedTools", "--append-system-prompt", "--session-id"}
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            rest = argv[i + 1:]
            prompt = rest[0] if rest else prompt
            break
        if arg in ("--resume", "-r"):
            resume = argv[i + 1] if i + 1 < len(argv) else None
            i += 2
            continue
        if arg in takes_value:
            i += 2
            continue
        if arg.startswith("-"):
            i += 1
            continue
        prompt = arg
        i += 1
    return prompt, resume


def bash(command: list[str]) -> tuple[str, bool]:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc), True
    return (done.stdout + done.stderr).strip() or "(no output)", done.returncode != 0


def tool_call(prompt: str, n: int) -> tuple[str, list[str]]:
    inside = subprocess.run(["git", "rev-parse", "--is-inside-work-tree"], capture_output=True, text=True)
    if os.environ.get("FAKE_CLAUDE_COMMIT", "1") != "1" or inside.stdout.strip() != "true":
        return "git status --short", ["git", "status", "--short"]
    with open("NOTES.md", "a", encoding="utf-8") as notes:
        notes.write(f"- fake claude, step {n}: {prompt[:200]}\n")
    subject = f"fake claude: step {n} of {prompt[:50]!r}"
    added, failed = bash(["git", "add", "--", "NOTES.md"])
    if failed:
        return "git add NOTES.md", ["git", "add", "--", "NOTES.md"]
    return (f"git add NOTES.md && git commit -m {subject!r}",
            ["git", "-c", "user.name=Fake Claude", "-c", "user.email=fake-claude@runstead.invalid",
             "commit", "-q", "-m", subject, "--", "NOTES.md"])


def turn(prompt: str, session_id: str, pause: float, turns: int, *, sleep, max_turns: bool = False,
         hold_s: float | None = None) -> None:
    """One turn: ``turns`` assistant messages, tool calls between, then the ``result``.
    ``sleep(seconds)`` returns False when the turn was interrupted (stream-json input);
    ``hold_s``, when given, is the pause after each tool call instead of ``pause``."""
    tokens_in = tokens_out = 0
    text = ""
    for n in range(1, turns + 1):
        if not sleep(pause if n == 1 or hold_s is None else hold_s):
            emit({"type": "user", "session_id": session_id, "message": {"role": "user", "content": [
                {"type": "text", "text": "[Request interrupted by user]"}]}})
            spent[0] += tokens_in * PRICE_IN + tokens_out * PRICE_OUT
            emit({"type": "result", "subtype": "error_during_execution", "is_error": True,
                  "duration_ms": int(pause * n * 1000), "num_turns": n, "session_id": session_id,
                  "total_cost_usd": round(spent[0], 6), "usage": {"input_tokens": tokens_in, "output_tokens": tokens_out}})
            return
        message_id = f"msg_{uuid.uuid4().hex[:12]}"
        usage = {"input_tokens": 1200 * n, "cache_read_input_tokens": 800, "output_tokens": 60 + 10 * n}
        tokens_in += usage["input_tokens"] + usage["cache_read_input_tokens"]
        tokens_out += usage["output_tokens"]
        last = n == turns
        text = (f"Done: {prompt[:80]!r} is handled; I committed my notes." if last
                else f"Turn {n}: looking at the repository for {prompt[:60]!r}.")
        emit({"type": "assistant", "session_id": session_id, "message": {
            "id": message_id, "type": "message", "role": "assistant", "model": "fake-claude",
            "content": [{"type": "text", "text": text}], "usage": usage}})
        if last:
            break
        shown, command = tool_call(prompt, n)
        tool_id = f"toolu_{uuid.uuid4().hex[:12]}"
        emit({"type": "assistant", "session_id": session_id, "message": {
            "id": message_id, "type": "message", "role": "assistant", "model": "fake-claude",
            "content": [{"type": "tool_use", "id": tool_id, "name": "Bash", "input": {"command": shown}}],
            "usage": usage}})
        output, failed = bash(command)
        emit({"type": "user", "session_id": session_id, "message": {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": tool_id, "content": output, "is_error": failed}]}})
    spent[0] += tokens_in * PRICE_IN + tokens_out * PRICE_OUT
    cost = round(spent[0], 6)
    emit({"type": "result", "subtype": "error_max_turns" if max_turns else "success", "is_error": max_turns,
          "duration_ms": int(pause * turns * 1000), "num_turns": turns, "session_id": session_id,
          "result": "" if max_turns else text, "total_cost_usd": cost,
          "usage": {"input_tokens": tokens_in, "cache_read_input_tokens": 0, "output_tokens": tokens_out}})


def input_format(argv: list[str]) -> str:
    return argv[argv.index("--input-format") + 1] if "--input-format" in argv[:-1] else "text"


def user_text(content) -> str:
    if isinstance(content, list):
        return "".join(b.get("text", "") for b in content if isinstance(b, dict) and b.get("type") == "text")
    return content if isinstance(content, str) else ""


def converse(session_id: str, pause: float, turns: int) -> int:
    """``--input-format stream-json`` (docs/claude-stream-input.md): one turn per ``user``
    line read while idle, an ``interrupt`` control request ends the running turn (answered
    at once), EOF ends the process after the running turn; a line that is not JSON: exit 1."""
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for line in sys.stdin:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    waiting: list[str] = []  # user lines read during a turn: turns of their own, after it
    ended = False

    def control(line: str) -> bool:
        """Handle one line; False for an interrupt (the caller ends its turn)."""
        nonlocal ended
        if line is None:
            ended = True
            return True
        try:
            event = json.loads(line)
        except ValueError:
            sys.stderr.write(f"Error parsing streaming input line: {line[:200]}\n")
            sys.exit(1)
        if event.get("type") == "control_request":
            emit({"type": "control_response", "response": {
                "subtype": "success", "request_id": event.get("request_id"), "response": {"still_queued": []}}})
            return (event.get("request") or {}).get("subtype") != "interrupt"
        if event.get("type") == "user":
            waiting.append(user_text((event.get("message") or {}).get("content")))
        return True

    def sleep(seconds: float) -> bool:
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            try:
                line = lines.get(timeout=left)
            except queue.Empty:
                return True
            if not control(line):
                return False
        return True

    slow_prompt = os.environ.get("FAKE_CLAUDE_SLOW_PROMPT", "")
    slow_pause = float(os.environ.get("FAKE_CLAUDE_SLOW_PAUSE_S", "30"))
    while True:
        while waiting:
            text = waiting.pop(0)
            turn(text, session_id, pause, turns, sleep=sleep,
                 hold_s=slow_pause if slow_prompt and slow_prompt in text else None)
        if ended:
            return 0
        control(lines.get())


def main() -> int:
    if sys.argv[1:] == ["--version"]:  # worker --check asks every preset CLI (G1); nothing runs
        print("2.1.328 (fake Claude Code: scripts/fake_claude.py speaks that version's stream-json)")
        return 0
    prompt, resume = parse_args(sys.argv[1:])
    stdin_text = ""
    if prompt is None and not sys.stdin.isatty() and input_format(sys.argv[1:]) == "text":
        stdin_text = sys.stdin.read()
        prompt = stdin_text
    prompt = prompt or ""
    record = os.environ.get("FAKE_CLAUDE_RECORD")
    if record:
        with open(record, "a", encoding="utf-8") as f:
            f.write(json.dumps({"argv": sys.argv[1:], "stdin": stdin_text, "cwd": os.getcwd()}) + "\n")
    pause = float(os.environ.get("FAKE_CLAUDE_PAUSE_S", "1.5"))
    turns = max(1, int(os.environ.get("FAKE_CLAUDE_TURNS", "3")))
    outcome = os.environ.get("FAKE_CLAUDE_RESULT", "success")
    session_id = resume or str(uuid.uuid4())
    emit({"type": "system", "subtype": "init", "cwd": os.getcwd(), "session_id": session_id, "model": "fake-claude",
          "tools": ["Bash", "Edit", "Read"], "permissionMode": "default", "apiKeySource": "none"})
    if "stream-json" in input_format(sys.argv[1:]):
        return converse(session_id, pause, turns)
    if outcome == "api_error":
        time.sleep(pause)
        text = "API Error: 500 {\"type\":\"error\",\"error\":{\"type\":\"api_error\",\"message\":\"Overloaded\"}}"
        emit({"type": "assistant", "session_id": session_id, "message": {
            "id": f"msg_{uuid.uuid4().hex[:12]}", "type": "message", "role": "assistant", "model": "<synthetic>",
            "content": [{"type": "text", "text": text}], "usage": {"input_tokens": 0, "output_tokens": 0}}})
        emit({"type": "result", "subtype": "success", "is_error": True, "api_error_status": 500,
              "terminal_reason": "api_error", "duration_ms": int(pause * 1000), "num_turns": 1, "result": text,
              "session_id": session_id, "total_cost_usd": 0, "usage": {"input_tokens": 0, "output_tokens": 0}})
        return int(os.environ.get("FAKE_CLAUDE_EXIT", "0"))
    turn(prompt, session_id, pause, turns, sleep=lambda s: time.sleep(s) or True,
         max_turns=outcome == "max_turns")
    return int(os.environ.get("FAKE_CLAUDE_EXIT", "0"))


if __name__ == "__main__":
    sys.exit(main())
