"""``manage.py install_hooks`` without Django (SPEC I5): merges RunStead's hook entries
into an agent CLI's user configuration.

Per agent (``config_dir`` default in brackets):

- ``claude`` [``~/.claude``]: ``settings.json`` ``hooks`` for SessionStart,
  UserPromptSubmit, Stop, Notification (matcher ``permission_prompt``), SessionEnd, the
  tool hooks PreToolUse, PostToolUse (matcher ``*``; I7: long turns), and
  PermissionRequest (matcher ``*``; Q3: the hook that waits for the owner's answer, its
  ``timeout`` ``approval_wait_s`` + 30 s, every other entry's 10 s);
- ``codex`` [``~/.codex``]: ``notify = [...]`` in ``config.toml`` (the dependable
  surface) and ``hooks.json`` for SessionStart, UserPromptSubmit, Stop, PreToolUse,
  PostToolUse, PermissionRequest (timeout as Claude Code's; they run once the owner
  trusts them);
- ``gemini`` [``~/.gemini``]: ``settings.json`` ``hooks`` for SessionStart, BeforeAgent,
  AfterAgent, Notification, SessionEnd, BeforeTool, AfterTool (timeouts in ms);
- ``opencode`` [``~/.config/opencode``]: ``plugins/runstead.js`` from
  ``integrations/opencode/runstead.js`` with the hook command filled in.

With ``alias`` (T3), the user's shell rc file (``shell_rc``, default by ``$SHELL``:
``~/.zshrc``, ``~/.bashrc``, else ``~/.profile``) gets one line,
``alias AGENT='<checkout>/scripts/runstead-term AGENT'`` with RunStead's comment, so the
agent started by its name runs under the terminal wrapper; ``uninstall`` removes that line
(and only it) whether or not ``alias`` is passed.

Every other entry is kept; RunStead's entries are the ones whose command runs
``machine/hooks/__main__.py``, or, as older versions wrote it, ``sessions_app/hooks/__main__.py``
or ``-m sessions_app.hooks``; an install rewrites those older entries to the current command.
A file that changes gets a timestamped backup first
(``<name>.runstead-<UTC>.bak``); an unchanged one is not rewritten, so a second run is
byte-equal. A malformed existing file is left untouched and raises InstallError. The
owner token goes only into the hook state directory's 0600 ``config.json``.
"""
import json
import os
import shlex
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from machine.files import write_atomic
from machine.hooks import AGENTS, store
from machine.hooks.approval import DEFAULT_WAIT_S
from machine.protocol import HOOK_SCRIPT, hook_python

# RunStead's entries: a command naming the hook's script (or the module, as written before)
# and the commands older versions wrote (``sessions_app/hooks/__main__.py``, ``-m sessions_app.hooks``),
# which an install rewrites to the current one.
MARKS = ("/".join(HOOK_SCRIPT), "machine.hooks", "sessions_app/hooks/__main__.py", "sessions_app.hooks")
PROJECT_ROOT = Path(__file__).resolve().parents[2]
OPENCODE_PLUGIN = PROJECT_ROOT / "integrations" / "opencode" / "runstead.js"
CLAUDE_TIMEOUT_S = 10
DEFAULT_APPROVAL_WAIT_S = int(DEFAULT_WAIT_S)  # Q3
APPROVAL_TIMEOUT_MARGIN_S = 30  # the PermissionRequest entry's timeout is approval_wait_s plus this
GEMINI_TIMEOUT_MS = 10000
WRAPPER = PROJECT_ROOT / "scripts" / "runstead-term"
ALIAS_COMMENT = "# RunStead terminal wrapper (install_hooks --uninstall removes it)"
CODEX_COMMENT = "# RunStead hook (manage.py install_hooks codex --uninstall removes it)"

# One entry per event (event -> matcher or None). The tool hooks are I7's: they keep a
# long turn RUNNING, and with nothing due they write nothing.
CLAUDE_EVENTS = {
    "SessionStart": None, "UserPromptSubmit": None, "Stop": None, "Notification": "permission_prompt",
    "SessionEnd": None, "PreToolUse": "*", "PostToolUse": "*", "PermissionRequest": "*",
}
CODEX_EVENTS = {"SessionStart": None, "UserPromptSubmit": None, "Stop": None, "PreToolUse": "*", "PostToolUse": "*",
                "PermissionRequest": "*"}
GEMINI_EVENTS = {
    "SessionStart": None, "BeforeAgent": None, "AfterAgent": None, "Notification": None, "SessionEnd": None,
    "BeforeTool": "*", "AfterTool": "*",
}


class InstallError(Exception):
    """A config the installer will not touch (malformed, or a conflicting entry)."""


@dataclass
class Change:
    path: Path
    action: str  # "created", "updated", "removed", "unchanged"
    detail: str = ""
    backup: Path | None = None


@dataclass
class Report:
    changes: list[Change] = field(default_factory=list)

    def lines(self) -> list[str]:
        out = []
        for c in self.changes:
            line = f"{c.path}: {c.action}"
            if c.detail:
                line += f" ({c.detail})"
            if c.backup:
                line += f"; backup at {c.backup}"
            out.append(line)
        return out


def hook_argv(agent: str, state_dir: Path | None = None) -> list[str]:
    """The command the CLI runs: this interpreter on this checkout (``env`` sets
    ``PYTHONPATH``, and ``RUNSTEAD_HOOK_DIR`` for a non-default state directory)."""
    argv = ["/usr/bin/env", f"PYTHONPATH={PROJECT_ROOT}"]
    if state_dir is not None and Path(state_dir) != Path.home() / ".runstead" / "hooks":
        argv.append(f"RUNSTEAD_HOOK_DIR={state_dir}")
    return argv + hook_python(sys.executable, str(PROJECT_ROOT)) + [agent]


def _ours(text: str) -> bool:
    """Whether a command (or one argument of it) is RunStead's hook."""
    return any(mark in text for mark in MARKS)


def compile_hook_modules() -> None:
    """Writes the bytecode of every module a hook imports (``machine.hooks``,
    ``machine.protocol`` and the shared ``outbox``, ``files``, ``settings``), as ``pip`` does at install: a hook runs in a fresh
    interpreter each time, and where ``PYTHONDONTWRITEBYTECODE`` is set it would
    otherwise compile them from source on every call, 7 ms of each (I1, I7). Python
    recompiles a stale file in memory itself. Raises nothing (a read-only checkout just
    stays slower)."""
    import compileall

    quiet = 2  # no listing, no errors printed: a file that does not compile fails its hook's own log
    compileall.compile_dir(PROJECT_ROOT / "machine" / "hooks", maxlevels=0, quiet=quiet)
    for name in ("__init__", "protocol/__init__", "outbox", "files", "settings"):
        compileall.compile_file(PROJECT_ROOT / "machine" / f"{name}.py", quiet=quiet)


def default_config_dir(agent: str) -> Path:
    home = Path.home()
    return {
        "claude": home / ".claude", "codex": home / ".codex", "gemini": home / ".gemini",
        "opencode": home / ".config" / "opencode",
    }[agent]


def _is_ours(entry) -> bool:
    return isinstance(entry, dict) and _ours(str(entry.get("command", "")))


def _read_json(path: Path) -> tuple[bytes | None, dict]:
    if not path.exists():
        return None, {}
    raw = path.read_bytes()
    if not raw.strip():
        return raw, {}
    try:
        data = json.loads(raw)
    except ValueError as error:
        raise InstallError(f"{path} is not valid JSON ({error}); left it untouched: fix it and run again") from None
    if not isinstance(data, dict):
        raise InstallError(f"{path} does not hold a JSON object; left it untouched")
    return raw, data


def _merge_groups(hooks: dict, event: str, group: dict | None, path: Path) -> None:
    """Removes RunStead's hook entries from one event's matcher groups (dropping groups
    left empty) and, unless ``group`` is None, puts ``group`` back (in place when the
    same one is there already)."""
    groups = hooks.get(event, [])
    if not isinstance(groups, list):
        raise InstallError(f"{path}: hooks.{event} is not a list; left it untouched")
    ours = [g for g in groups if isinstance(g, dict) and any(_is_ours(h) for h in g.get("hooks") or [])]
    if group is not None and ours == [group]:
        return
    kept = []
    for g in groups:
        if isinstance(g, dict) and isinstance(g.get("hooks"), list) and any(_is_ours(h) for h in g["hooks"]):
            rest = [h for h in g["hooks"] if not _is_ours(h)]
            if rest:
                kept.append({**g, "hooks": rest})
            continue
        kept.append(g)
    if group is not None:
        kept.append(group)
    if kept:
        hooks[event] = kept
    else:
        hooks.pop(event, None)


def _json_hooks(data: dict, groups: dict, path: Path, uninstall: bool) -> dict:
    hooks = data.get("hooks", {})
    if not isinstance(hooks, dict):
        raise InstallError(f"{path}: \"hooks\" is not an object; left it untouched")
    hooks = dict(hooks)
    for event, group in groups.items():
        _merge_groups(hooks, event, None if uninstall else group, path)
    result = dict(data)
    if hooks:
        result["hooks"] = hooks
    else:
        result.pop("hooks", None)
    return result


def _dump_json(data: dict) -> bytes:
    return (json.dumps(data, indent=2, ensure_ascii=False) + "\n").encode()


def _write(path: Path, old: bytes | None, new: bytes | None, detail: str) -> Change:
    """Writes ``new`` (None: remove the file) atomically, with a backup of ``old``."""
    if new == old:
        return Change(path, "unchanged")
    backup = None
    if old is not None:
        backup = path.with_name(f"{path.name}.runstead-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.bak")
        n = 1
        while backup.exists():
            backup = path.with_name(f"{path.name}.runstead-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{n}.bak")
            n += 1
        backup.write_bytes(old)
    if new is None:
        path.unlink()
        return Change(path, "removed", detail, backup)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, new, mode=path.stat().st_mode & 0o777 if path.exists() else 0o644)
    return Change(path, "updated" if old is not None else "created", detail, backup)


def _claude_like(path: Path, events: dict, command: str, timeout, uninstall: bool, name: str | None = None,
                 timeouts: dict | None = None) -> tuple:
    old, data = _read_json(path)
    groups = {}
    for event, matcher in events.items():
        entry = {"type": "command", "command": command, "timeout": (timeouts or {}).get(event, timeout)}
        if name:
            entry = {"name": name, **entry}
        group = {"hooks": [entry]}
        if matcher:
            group = {"matcher": matcher, **group}
        groups[event] = group
    new_data = _json_hooks(data, groups, path, uninstall)
    if new_data == data:
        new = old  # nothing to change: the user's bytes stay as they are
    else:
        new = _dump_json(new_data)
    if old is None and not new_data:
        new = None
    verb = "removed" if uninstall else "RunStead hooks for"
    return path, old, new, f"{verb} {', '.join(events)}"


def _codex_toml(path: Path, argv: list[str], uninstall: bool) -> tuple:
    old = path.read_bytes() if path.exists() else None
    text = old.decode() if old is not None else ""
    try:
        parsed = tomllib.loads(text)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise InstallError(f"{path} is not valid TOML ({error}); left it untouched: fix it and run again") from None
    line = "notify = " + json.dumps(argv)
    lines = text.splitlines(keepends=True)
    ours = [
        i for i, text_line in enumerate(lines)
        if (text_line.startswith("notify") and _ours(text_line)) or text_line.rstrip("\n") == CODEX_COMMENT
    ]
    current = parsed.get("notify")
    if current is not None and not (isinstance(current, list) and any(_ours(str(a)) for a in current)):
        if uninstall:
            return path, old, old, ""
        raise InstallError(
            f"{path} already sets notify = {json.dumps(current)}; Codex runs one notify program, so RunStead "
            "will not replace yours. Remove it (or call it from a script that also runs "
            f"{shlex.join(argv)}) and run again. Left the file untouched."
        )
    rest = [text_line for i, text_line in enumerate(lines) if i not in ours]
    if uninstall:
        new = "".join(rest).encode() if old is not None else None
        return path, old, new, "removed notify"
    # A top-level key must come before the first table: the top of the file is always right.
    new = (CODEX_COMMENT + "\n" + line + "\n" + "".join(rest)).encode()
    if lines[:2] == [CODEX_COMMENT + "\n", line + "\n"]:
        new = old
    return path, old, new, "notify"


def _opencode(path: Path, argv: list[str], uninstall: bool) -> tuple:
    old = path.read_bytes() if path.exists() else None
    if uninstall:
        return path, old, None if old is not None else None, "removed the plugin"
    template = OPENCODE_PLUGIN.read_text()
    default = 'const HOOK_COMMAND = ["python3", "-m", "machine.hooks", "opencode"]'
    if default not in template:
        raise InstallError(f"{OPENCODE_PLUGIN} lost its HOOK_COMMAND line")
    new = template.replace(default, "const HOOK_COMMAND = " + json.dumps(argv)).encode()
    return path, old, new, "the RunStead plugin"


def default_shell_rc(shell: str | None = None) -> Path:
    """The rc file of the user's shell (``$SHELL``): ``~/.zshrc``, ``~/.bashrc`` or ``~/.profile``."""
    name = Path(shell if shell is not None else os.environ.get("SHELL", "")).name
    return Path.home() / {"zsh": ".zshrc", "bash": ".bashrc"}.get(name, ".profile")


def alias_line(agent: str) -> str:
    """T3: the shell line that starts ``agent`` under the terminal wrapper."""
    return f"alias {agent}={shlex.quote(shlex.join([str(WRAPPER), agent]))}  {ALIAS_COMMENT}"


def _alias(path: Path, agent: str, uninstall: bool) -> tuple:
    """The rc file with RunStead's alias line for ``agent`` (one, replacing an older one of
    ours), or without it on ``uninstall``; every other line kept as it is."""
    old = path.read_bytes() if path.exists() else None
    text = old.decode("utf-8", errors="surrogateescape") if old is not None else ""
    lines = text.splitlines(keepends=True)
    ours = [i for i, line in enumerate(lines) if line.startswith(f"alias {agent}=") and ALIAS_COMMENT in line]
    kept = [line for i, line in enumerate(lines) if i not in ours]
    if not uninstall:
        wanted = alias_line(agent) + "\n"
        if ours:
            kept.insert(ours[0], wanted)
        else:
            if kept and not kept[-1].endswith("\n"):
                kept[-1] += "\n"
            kept.append(wanted)
    new = "".join(kept).encode("utf-8", errors="surrogateescape")
    if old is None and uninstall:
        new = None
    return path, old, new, f"`{agent}` runs under runstead-term"


def install(agent: str, *, server: str, token: str | None = None, config_dir: Path | None = None,
            state_dir: Path | None = None, uninstall: bool = False, approval_wait_s: int | None = None,
            machine: str | None = None, alias: bool = False, shell_rc: Path | None = None) -> Report:
    """Installs (or with ``uninstall`` removes) RunStead's hooks for ``agent``; see the
    module docstring. ``approval_wait_s``: how long the PermissionRequest hook waits for
    the owner (Q3; default: the value configured before, else 600 s), kept in
    ``config.json`` when not the default. ``machine``: the id of the paired machine the
    hooks run on (T1: sessions are bound to it and can take messages; default: the one
    configured before). Every file is checked before any is written.
    Raises InstallError."""
    if agent not in AGENTS:
        raise InstallError(f"unknown agent {agent!r}; one of {', '.join(AGENTS)}")
    if approval_wait_s is not None and not 1 <= approval_wait_s <= 86400:
        raise InstallError("--approval-wait-s: from 1 to 86400 seconds")
    state_dir = Path(state_dir or store.default_state_dir())
    existing = store.read_config(state_dir)
    if approval_wait_s is None:
        known = existing.get("approval_wait_s")
        approval_wait_s = known if isinstance(known, int) and 1 <= known <= 86400 else DEFAULT_APPROVAL_WAIT_S
    config_dir = Path(config_dir).expanduser() if config_dir else default_config_dir(agent)
    argv = hook_argv(agent, state_dir)
    command = shlex.join(argv)
    if agent == "claude":
        timeouts = {"PermissionRequest": approval_wait_s + APPROVAL_TIMEOUT_MARGIN_S}
        plans = [_claude_like(config_dir / "settings.json", CLAUDE_EVENTS, command, CLAUDE_TIMEOUT_S, uninstall,
                              timeouts=timeouts)]
    elif agent == "gemini":
        plans = [_claude_like(config_dir / "settings.json", GEMINI_EVENTS, command, GEMINI_TIMEOUT_MS, uninstall,
                              name="runstead")]
    elif agent == "codex":
        plans = [
            _codex_toml(config_dir / "config.toml", argv, uninstall),
            _claude_like(config_dir / "hooks.json", CODEX_EVENTS, command, CLAUDE_TIMEOUT_S, uninstall,
                         timeouts={"PermissionRequest": approval_wait_s + APPROVAL_TIMEOUT_MARGIN_S}),
        ]
    else:
        plans = [_opencode(config_dir / "plugins" / "runstead.js", argv, uninstall)]

    rc = Path(shell_rc).expanduser() if shell_rc else default_shell_rc()
    if alias or uninstall:
        plan = _alias(rc, agent, uninstall)
        if alias or plan[1] != plan[2]:  # uninstall reports the rc file only when it held our line
            plans.append(plan)

    report = Report()
    if not uninstall:
        compile_hook_modules()
        token = token or existing.get("token")
        if not token:
            raise InstallError("no owner token: pass --token (it is kept in the hook state directory, mode 0600)")
        extra = {} if approval_wait_s == DEFAULT_APPROVAL_WAIT_S else {"approval_wait_s": approval_wait_s}
        machine = machine or existing.get("machine")
        if machine:
            extra["machine"] = str(machine)
        if existing != {"server": server, "token": token, **extra}:
            path = store.write_config(state_dir, server=server, token=token, extra=extra)
            action = "updated" if existing else "created"
            report.changes.append(Change(path, action, "server URL and owner token, mode 0600"))
        else:
            report.changes.append(Change(state_dir / store.CONFIG_NAME, "unchanged"))
    for path, old, new, detail in plans:
        report.changes.append(_write(path, old, new, detail))
    return report
