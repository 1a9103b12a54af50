"""Agent CLI presets (SPEC G1, G6, W4): what the worker knows about real coding agents.

A preset is a small declarative entry: an argv template, the name of its stdout parser
(``tasks_app.worker.parsers``), how the prompt is placed, and how a session is resumed.
A new CLI is one entry here plus its parser and fixtures.

Templates are lists of strings; nothing is ever joined into a command line or given to
a shell (K4). Elements:

- ``"{binary}"``: the executable (the profile's ``binary``, default the preset's name);
- ``"{extra_args}"``: the profile's ``extra_args``, spliced in as separate elements;
- ``"{resume}"``: the preset's ``resume`` elements when the task continues an agent
  session (G6), otherwise nothing;
- ``{prompt}``, ``{folder}``, ``{session_id}`` anywhere inside an element: replaced by
  the value, in one pass (a prompt containing ``{folder}`` stays as written). With
  ``prompt_via = "stdin"`` every element holding ``{prompt}`` is dropped and the prompt
  goes on stdin instead.

The prompt sits after ``--`` (or in a ``--flag=VALUE`` element) so a prompt that starts
with ``-`` is never read as an option.
"""
from __future__ import annotations

from dataclasses import dataclass, field

PROMPT_VIA = ("arg", "stdin")


@dataclass(frozen=True)
class Preset:
    """One agent CLI. ``resume`` is None when the CLI cannot resume a session by id."""

    name: str
    argv: tuple[str, ...]
    parser: str
    resume: tuple[str, ...] | None = None
    prompt_via: str = "arg"
    stdin_ok: bool = True
    env: dict = field(default_factory=dict)
    doc: str = ""


PRESETS: dict[str, Preset] = {
    # Claude Code: `claude -p --output-format stream-json --verbose` (stream-json needs
    # --verbose with -p); `--resume ID` continues a session; with no prompt argument -p
    # reads the prompt from stdin.
    "claude": Preset(
        name="claude",
        argv=("{binary}", "-p", "--output-format", "stream-json", "--verbose", "{resume}", "{extra_args}",
              "--", "{prompt}"),
        parser="claude",
        resume=("--resume", "{session_id}"),
        doc="Claude Code headless, stream-json",
    ),
    # Codex CLI: `codex exec --json PROMPT`; `codex exec resume ID PROMPT` continues a
    # thread (exec's own flags go before the subcommand). Without a prompt argument it
    # reads stdin.
    "codex": Preset(
        name="codex",
        argv=("{binary}", "exec", "--json", "{extra_args}", "{resume}", "--", "{prompt}"),
        parser="codex",
        resume=("resume", "{session_id}"),
        doc="Codex CLI exec, JSON lines",
    ),
    # Gemini CLI: `gemini --output-format stream-json -p PROMPT` (`--prompt=VALUE` so a
    # leading dash stays part of the prompt); headless on a non-TTY stdin without -p.
    # `--resume` takes "latest", a list index or the full session UUID (docs/cli/
    # session-management.md): the id from the stream's `init` event.
    "gemini": Preset(
        name="gemini",
        argv=("{binary}", "--output-format", "stream-json", "{resume}", "{extra_args}", "--prompt={prompt}"),
        parser="gemini",
        resume=("--resume={session_id}",),
        doc="Gemini CLI headless, stream-json",
    ),
    # opencode: `opencode run --format json MESSAGE`; `--session ID` continues one. It
    # appends piped stdin to the message, so stdin works too.
    "opencode": Preset(
        name="opencode",
        argv=("{binary}", "run", "--format", "json", "{resume}", "{extra_args}", "--", "{prompt}"),
        parser="opencode",
        resume=("--session", "{session_id}"),
        doc="opencode run, JSON events",
    ),
    # aider: `aider --message PROMPT --yes` runs one instruction and exits; plain text.
    # No session ids (its chat history is per folder), and no prompt on stdin.
    "aider": Preset(
        name="aider",
        argv=("{binary}", "--yes", "{extra_args}", "--message={prompt}"),
        parser="aider",
        stdin_ok=False,
        doc="aider one-shot message, plain text",
    ),
}


class ResumeUnsupported(Exception):
    """The profile cannot continue an agent session (G6: ``resume_unsupported``)."""


def expand(template: tuple[str, ...] | list[str], *, binary: str, prompt: str, folder: str, prompt_via: str,
           extra_args: tuple[str, ...] = (), resume: tuple[str, ...] | None = None,
           agent_session_id: str | None = None, inline: bool = True) -> list[str]:
    """The argv for one run, from a template (module docstring for the elements).

    ``agent_session_id`` set and ``resume`` None -> ``ResumeUnsupported``. Every value is
    inserted whole into one element; the prompt arrives byte-equal (W4). ``inline=False``
    (a profile's own ``argv``, O4) replaces only elements that are exactly a placeholder,
    so a prompt can never land inside, say, a ``sh -c`` string someone wrote.
    """
    if agent_session_id is not None and resume is None:
        raise ResumeUnsupported("this profile cannot resume an agent session")
    values = {"prompt": prompt, "folder": folder, "session_id": agent_session_id or "", "binary": binary}
    out: list[str] = []
    for element in template:
        if element == "{binary}":
            out.append(binary)
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
