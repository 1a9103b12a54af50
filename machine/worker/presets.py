"""Agent CLI presets (SPEC G1, G6, W4): what the worker knows about real coding agents.

A preset is a small declarative entry: an argv template, the name of its stdout parser
(``machine.worker.parsers``), how the prompt is placed, and how a session is resumed.
A new CLI is one entry here plus its parser and fixtures.

Templates are lists of strings; nothing is ever joined into a command line or given to
a shell (K4). Elements:

- ``"{binary}"``: the executable (the profile's ``binary``, default the preset's name);
- ``"{extra_args}"``: the profile's ``extra_args``, spliced in as separate elements;
- ``"{resume}"``: the preset's ``resume`` elements when the task continues an agent
  session (G6), otherwise nothing;
- ``{prompt}``, ``{folder}``, ``{session_id}``, ``{record}`` (the path of the preset's
  ``record`` file) anywhere inside an element: replaced by the value, in one pass (a prompt containing ``{folder}`` stays as written). With
  ``prompt_via = "stdin"`` every element holding ``{prompt}`` is dropped and the prompt
  goes on stdin instead.

The prompt sits after ``--`` (or in a ``--flag=VALUE`` element, or on stdin) so a
prompt that starts with ``-`` is never read as an option.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

PROMPT_VIA = ("arg", "stdin")
# C11: opencode's live conversation runs ``opencode serve`` behind this bridge (stdio to
# the launcher, HTTP to the loopback server), by path with ``python -I`` as the launcher.
OPENCODE_BRIDGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "opencode_bridge.py")


@dataclass(frozen=True)
class Preset:
    """One agent CLI. ``resume`` is None when the CLI cannot resume a session by id.

    ``prompt_vias`` are the ways the CLI takes a prompt intact (the first is the default);
    ``record`` names a file in the operation directory where the CLI writes a
    machine-readable record of its run (``{record}`` in argv is its path; the parser
    reads it when the agent ends, G3); ``tested_version`` is the CLI version the preset
    was proven against (tests drive that real CLI; ``worker --check`` compares).
    """

    name: str
    argv: tuple[str, ...]
    parser: str
    tested_version: str
    resume: tuple[str, ...] | None = None
    prompt_vias: tuple[str, ...] = PROMPT_VIA
    record: str | None = None
    env: dict = field(default_factory=dict)
    doc: str = ""
    asks: bool = False  # Q5: the CLI takes a per-run PermissionRequest hook (approvals = "ask")
    live_asks: bool = False  # Q5: its live conversation asks the owner (no per-run argv: the environment)
    live_argv: tuple[str, ...] | None = None

    @property
    def prompt_via(self) -> str:
        return self.prompt_vias[0]

    @property
    def conversation(self) -> str:
        """C1: ``live``, ``resume`` or ``none``."""
        return "live" if self.live_argv else "resume" if self.resume else "none"


# Each entry was checked against the real CLI at ``tested_version``, offline against a
# local fake of its model API (tests/test_agent_presets_real.py; ../shared/AGENTS.md).
PRESETS: dict[str, Preset] = {
    # Claude Code: `claude -p --output-format stream-json --verbose` (stream-json needs
    # --verbose with -p); `--resume ID` continues a session; with no prompt argument -p
    # reads the prompt from stdin. Its exit status is not its verdict: the final
    # `result` event's `is_error` is (an API error exits 1 in 2.1.328, 0 in others).
    "claude": Preset(
        name="claude",
        argv=("{binary}", "-p", "--output-format", "stream-json", "--verbose", "{resume}", "{extra_args}",
              "--", "{prompt}"),
        parser="claude",
        tested_version="2.1.328",
        resume=("--resume", "{session_id}"),
        doc="Claude Code headless, stream-json",
        asks=True,  # `--settings '<json>'` adds a PermissionRequest hook for one run (Q5)
        # C1: `--input-format stream-json`: one {"type": "user", ...} line per message on
        # stdin, a `result` line per turn, a control_request interrupts the turn, EOF ends.
        # C9: `--replay-user-messages` echoes each user line (with the `uuid` written on it)
        # when the agent takes it: a line written mid-turn joins the running turn at its next
        # tool boundary or opens the next turn, and the echo says which.
        live_argv=("{binary}", "-p", "--input-format", "stream-json", "--output-format", "stream-json", "--verbose",
                   "--replay-user-messages", "{resume}", "{extra_args}"),
    ),
    # Codex CLI: `codex exec --json PROMPT`; `codex exec resume ID PROMPT` continues a
    # thread (exec's own flags go before the subcommand). It reads stdin whenever stdin
    # is not a terminal, so an open pipe hangs it: the worker gives it /dev/null. Outside
    # a git repository it refuses to start without --skip-git-repo-check; its default
    # read-only sandbox fails every write, so the task's folder is writable
    # (`--sandbox workspace-write`: writes stay inside it). An API error is `turn.failed`
    # and exit 1.
    "codex": Preset(
        name="codex",
        argv=("{binary}", "exec", "--json", "--skip-git-repo-check", "--sandbox", "workspace-write",
              "{extra_args}", "{resume}", "--", "{prompt}"),
        parser="codex",
        tested_version="0.169.0",
        resume=("resume", "{session_id}"),
        doc="Codex CLI exec, JSON lines",
        # C11: `codex app-server`, JSON-RPC on stdio (docs/codex-app-server.md; the
        # protocol is machine/worker/live_agents.py's AppServer): the handshake, then one
        # `turn/start` per message. The profile's extra_args are exec's flags: not given.
        live_argv=("{binary}", "app-server"),
    ),
    # Gemini CLI: `gemini --output-format stream-json --prompt=PROMPT` (`--prompt=VALUE`
    # so a leading dash stays part of the prompt). Headless it registers no shell tool
    # unless `--yolo`; an untrusted folder exits 55 (the folder passed W4's checks, so it
    # is trusted for the run). An API error is `result{status: "error"}` and exits with
    # the HTTP status mod 256 (400 -> 144). `--resume` takes the full session UUID from
    # the stream's `init` event (sessions are kept per folder).
    "gemini": Preset(
        name="gemini",
        argv=("{binary}", "--output-format", "stream-json", "--yolo", "{resume}", "{extra_args}",
              "--prompt={prompt}"),
        parser="gemini",
        tested_version="0.61.0",
        resume=("--resume={session_id}",),
        env={"GEMINI_CLI_TRUST_WORKSPACE": "true"},
        doc="Gemini CLI headless, stream-json",
    ),
    # opencode: `opencode run --format json`, the message on stdin: a message given as an
    # argument reaches the model wrapped in quotes when it holds a space (1.18.33), stdin
    # arrives byte-equal. `--session ID` continues one. An API error is an `error` event
    # and exit 1.
    "opencode": Preset(
        name="opencode",
        argv=("{binary}", "run", "--format", "json", "{resume}", "{extra_args}"),
        parser="opencode",
        tested_version="1.18.33",
        resume=("--session", "{session_id}"),
        prompt_vias=("stdin",),
        doc="opencode run, JSON events, prompt on stdin",
        # C11: `opencode serve` on 127.0.0.1 with a random password, driven over HTTP by
        # machine/opencode_bridge.py (the launcher's agent: JSON lines on its stdin and
        # stdout; docs/opencode-server.md; live_agents.OpencodeServe). The profile's
        # extra_args are run's flags: not given.
        live_argv=(sys.executable, "-I", OPENCODE_BRIDGE, "{binary}"),
        # Q5: the bridge answers each `permission.asked` of its session: the owner decides
        # (the task's credential in its environment) or, without it, rejected at once.
        # `opencode run` rejects by itself (no hook): a headless task does not ask.
        live_asks=True,
    ),
    # aider: `aider --message PROMPT --yes` runs one instruction and exits 0 whatever
    # happened, API errors included; plain text. Its `--analytics-log` (kept local with
    # --no-analytics) is the record of what happened: no `message_send` after a
    # `message_send_starting` is a failed message. --yes would also accept an upgrade
    # prompt, hence --no-check-update. No session ids (its chat history is per folder),
    # and no prompt on stdin.
    "aider": Preset(
        name="aider",
        argv=("{binary}", "--yes", "--no-check-update", "--no-analytics", "--analytics-log={record}",
              "{extra_args}", "--message={prompt}"),
        parser="aider",
        tested_version="0.86.2",
        prompt_vias=("arg",),
        record="aider-analytics.jsonl",
        doc="aider one-shot message, plain text and its analytics log",
    ),
}


class ResumeUnsupported(Exception):
    """The profile cannot continue an agent session (G6: ``resume_unsupported``)."""


def expand(template: tuple[str, ...] | list[str], *, binary: str, prompt: str, folder: str, prompt_via: str,
           extra_args: tuple[str, ...] = (), resume: tuple[str, ...] | None = None,
           agent_session_id: str | None = None, inline: bool = True, record: str = "{record}",
           after_binary: tuple[str, ...] = ()) -> list[str]:
    """The argv for one run, from a template (module docstring for the elements).

    ``agent_session_id`` set and ``resume`` None -> ``ResumeUnsupported``. Every value is
    inserted whole into one element; the prompt arrives byte-equal (W4). ``inline=False``
    (a profile's own ``argv``, O4) replaces only elements that are exactly a placeholder,
    so a prompt can never land inside, say, a ``sh -c`` string someone wrote.
    ``after_binary`` (Q5: ``--settings <json>``) goes right after the ``{binary}`` element.
    """
    if agent_session_id is not None and resume is None:
        raise ResumeUnsupported("this profile cannot resume an agent session")
    values = {"prompt": prompt, "folder": folder, "session_id": agent_session_id or "", "binary": binary,
              "record": record}
    out: list[str] = []
    for element in template:
        if element == "{binary}":
            out.append(binary)
            out.extend(after_binary)
        elif element == "{extra_args}":
            out.extend(extra_args)
        elif element == "{resume}":
            if agent_session_id is not None:
                out.extend(_fill(e, values) for e in resume)
        elif "{prompt}" in element and prompt_via == "stdin" and (inline or element == "{prompt}"):
            continue
        elif inline:
            out.append(_fill(element, values))
        elif element.startswith("{") and element.endswith("}") and element[1:-1] in values:
            out.append(values[element[1:-1]])
        else:
            out.append(element)
    return out


def _fill(element: str, values: dict) -> str:
    """Replace ``{name}`` placeholders of the template element in one left-to-right pass,
    so text inserted from a value is never looked at again."""
    out, i = [], 0
    while i < len(element):
        if element[i] == "{":
            end = element.find("}", i)
            key = element[i + 1:end] if end != -1 else None
            if key in values:
                out.append(values[key])
                i = end + 1
                continue
        out.append(element[i])
        i += 1
    return "".join(out)
