"""The worker's local configuration (SPEC O4, W4, W7, W8).

TOML file::

    allowed_roots = ["/Users/me/code"]
    max_concurrent = 4          # W8
    prevent_idle_sleep = true   # W7 (macOS only)

    [profiles.claude]
    preset = "claude"                      # G1: argv, parser, resume from machine.worker.presets
    extra_args = ["--permission-mode", "acceptEdits"]
    binary = "/opt/homebrew/bin/claude"    # optional; default: looked up on PATH at start
    isolation = "worktree"                 # G7: each task on its own branch (a task's "isolation" wins)
    approvals = "ask"                      # Q5: what would prompt asks the owner (default "off": denied)
    conversation = "live"                  # C1: the preset's most ("live" for claude, codex and opencode); "resume", "none"

    [profiles.script]
    argv = ["/usr/bin/python3", "job.py", "{prompt}"]   # "{prompt}" -> the prompt as ONE argument
    prompt_via = "arg"                     # or "stdin"
    env = {FOO = "bar"}

A profile with a ``preset`` takes that preset's keys; every key the profile sets wins
(``argv``, ``env``, ``binary``, ``extra_args``, ``prompt_via``, ``parser``). A task's
``agent`` names a profile; nothing else ever runs (W4).
"""
from __future__ import annotations

import os
import shutil
import tomllib
from dataclasses import dataclass, field

from .approvals import APPROVALS
from .parsers import PARSERS
from .presets import PRESETS, PROMPT_VIA, expand

DEFAULT_MAX_CONCURRENT = 4


class ConfigError(Exception):
    pass


PROFILE_KEYS = {"preset", "argv", "env", "binary", "extra_args", "prompt_via", "parser", "isolation", "approvals",
                "conversation"}
CONVERSATIONS = ("live", "resume", "none")  # C1
ISOLATIONS = ("none", "worktree")  # G7


@dataclass(frozen=True)
class Profile:
    """One ``[profiles.NAME]`` table, resolved against its preset (G1).

    ``argv`` is a template (``machine.worker.presets``); ``binary`` is a name looked up
    on PATH when a task starts, or an absolute path; ``resume`` the preset's resume
    elements (None: the profile refuses follow-ups with ``resume_unsupported``, G6).
    ``from_preset`` says whether ``argv`` is the preset's own (placeholders inside
    elements allowed) or the profile's (whole elements only, O4). ``record`` and
    ``tested_version`` come from the preset (``presets.Preset``). ``approvals``
    (Q5): ``"ask"`` runs each task with the owner answering what would prompt
    (``machine.worker.approvals``), ``"off"`` leaves it to the CLI (headless: denied).
    ``conversation`` (C1): ``"live"`` (``live_argv``, the preset's streaming-input argv),
    ``"resume"`` (each message a follow-up) or ``"none"`` (refused).
    """

    name: str
    argv: tuple[str, ...]
    prompt_via: str = "arg"
    env: dict = field(default_factory=dict)
    preset: str | None = None
    binary: str | None = None
    extra_args: tuple[str, ...] = ()
    parser: str = "text"
    resume: tuple[str, ...] | None = None
    from_preset: bool = False
    isolation: str = "none"
    record: str | None = None
    tested_version: str | None = None
    approvals: str = "off"
    conversation: str = "none"
    live_argv: tuple[str, ...] | None = None

    @property
    def executable(self) -> str:
        """The configured executable: ``binary`` where argv has a ``{binary}`` element,
        else the argv's first element."""
        if "{binary}" in self.argv:
            return self.binary or "{binary}"
        return self.argv[0]

    def find_binary(self, path: str | None) -> str | None:
        """G1: the executable's absolute path on ``path`` (a PATH string), or None."""
        exe = self.executable
        if os.sep in exe:
            return exe if os.path.isfile(exe) and os.access(exe, os.X_OK) else None
        return shutil.which(exe, path=path)

    def command(self, *, prompt: str, folder: str, agent_session_id: str | None = None,
                binary: str | None = None, op_dir: str | None = None, after_binary: tuple[str, ...] = (),
                live: bool = False) -> list[str]:
        """The argv to execute (W4, K4): no shell ever sees it; the prompt is one element
        (or, with ``prompt_via = "stdin"``, on stdin). ``binary`` (a resolved path) replaces
        the ``{binary}`` element, followed by ``after_binary`` (Q5's ``--settings``);
        ``{record}`` becomes ``record_path(op_dir)``. ``live``: a live conversation's argv
        (C1; the prompt is its first message on stdin, not an argument). Raises
        ``presets.ResumeUnsupported`` for a follow-up on a profile that cannot resume (G6)."""
        return expand(self.live_argv if live else self.argv, binary=binary or self.executable, prompt=prompt, folder=folder,
                      prompt_via=self.prompt_via, extra_args=self.extra_args, resume=self.resume,
                      agent_session_id=agent_session_id, inline=self.from_preset,
                      record=self.record_path(op_dir) or "{record}", after_binary=after_binary)

    def asks_owner(self, *, live: bool) -> bool:
        """Q5: whether a run of this profile asks its owner (``approvals = "ask"``): every
        run of a preset whose CLI takes a per-run hook (``Preset.asks``: Claude Code), or
        the live conversation (C1) of one whose bridge asks (``Preset.live_asks``: opencode;
        its headless ``run`` rejects by itself)."""
        preset = PRESETS.get(self.preset or "")
        if self.approvals != "ask" or preset is None:
            return False
        return preset.asks or (live and preset.live_asks and self.live_argv is not None)

    def asks_through_settings(self) -> bool:
        """Q5: whether asking adds the CLI's per-run settings to the argv (``Preset.asks``;
        otherwise the environment alone carries it: ``approvals.asking_env``)."""
        preset = PRESETS.get(self.preset or "")
        return preset is not None and preset.asks

    def record_path(self, op_dir: str | None) -> str | None:
        """Where the agent writes its run record (the preset's ``record``) for an
        operation directory, or None (no record, or no directory given)."""
        return os.path.join(op_dir, self.record) if self.record and op_dir else None

    def describe(self) -> dict:
        """The resolved profile for ``worker --check`` (placeholders left visible)."""
        return {"name": self.name, "preset": self.preset, "parser": self.parser, "prompt_via": self.prompt_via,
                "argv": list(self.argv), "binary": self.executable, "extra_args": list(self.extra_args),
                "resume": list(self.resume) if self.resume is not None else None, "env": sorted(self.env),
                "isolation": self.isolation, "approvals": self.approvals, "conversation": self.conversation}


@dataclass(frozen=True)
class WorkerConfig:
    allowed_roots: tuple[str, ...] = ()
    profiles: dict = field(default_factory=dict)
    max_concurrent: int = DEFAULT_MAX_CONCURRENT
    prevent_idle_sleep: bool = True


def parse_config(data: dict) -> WorkerConfig:
    """Validate a parsed TOML document; raises ``ConfigError`` with a readable message."""
    roots = data.get("allowed_roots", [])
    if not isinstance(roots, list) or not all(isinstance(r, str) and os.path.isabs(r) for r in roots):
        raise ConfigError("allowed_roots must be a list of absolute paths")
    max_concurrent = data.get("max_concurrent", DEFAULT_MAX_CONCURRENT)
    if not isinstance(max_concurrent, int) or isinstance(max_concurrent, bool) or max_concurrent < 1:
        raise ConfigError("max_concurrent must be an integer >= 1")
    prevent = data.get("prevent_idle_sleep", True)
    if not isinstance(prevent, bool):
        raise ConfigError("prevent_idle_sleep must be true or false")
    profiles = {}
    raw_profiles = data.get("profiles", {})
    if not isinstance(raw_profiles, dict):
        raise ConfigError("profiles must be a table of [profiles.NAME] tables")
    for name, spec in raw_profiles.items():
        if not isinstance(spec, dict):
            raise ConfigError(f"profiles.{name} must be a table")
        profiles[name] = parse_profile(name, spec)
    return WorkerConfig(
        allowed_roots=tuple(os.path.realpath(r) for r in roots),
        profiles=profiles,
        max_concurrent=max_concurrent,
        prevent_idle_sleep=prevent,
    )


def _strings(value) -> bool:
    return isinstance(value, list) and all(isinstance(a, str) for a in value)


def parse_profile(name: str, spec: dict) -> Profile:
    """One profile table -> ``Profile`` (G1: the profile's keys win over its preset's).
    Raises ``ConfigError`` naming the key."""
    unknown = sorted(set(spec) - PROFILE_KEYS)
    if unknown:
        raise ConfigError(f"profiles.{name}: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(PROFILE_KEYS))})")
    preset_name = spec.get("preset")
    preset = None
    if preset_name is not None:
        preset = PRESETS.get(preset_name) if isinstance(preset_name, str) else None
        if preset is None:
            raise ConfigError(f"profiles.{name}.preset must be one of {', '.join(PRESETS)}")
    argv = spec.get("argv")
    if argv is not None and (not _strings(argv) or not argv):
        raise ConfigError(f"profiles.{name}.argv must be a non-empty list of strings")
    if argv is None and preset is None:
        raise ConfigError(f"profiles.{name} needs argv = [...] or preset = \"{'|'.join(PRESETS)}\"")
    binary = spec.get("binary")
    if binary is not None and (not isinstance(binary, str) or not binary or
                               (os.sep in binary and not os.path.isabs(binary))):
        raise ConfigError(f"profiles.{name}.binary must be a command name or an absolute path")
    extra_args = spec.get("extra_args", [])
    if not _strings(extra_args):
        raise ConfigError(f"profiles.{name}.extra_args must be a list of strings")
    default_via = preset.prompt_via if preset else "arg"
    prompt_via = spec.get("prompt_via", default_via)
    if prompt_via not in PROMPT_VIA:
        raise ConfigError(f"profiles.{name}.prompt_via must be 'arg' or 'stdin'")
    if preset is not None and prompt_via not in preset.prompt_vias and argv is None:
        how = "as an argument" if preset.prompt_via == "arg" else "on stdin"
        raise ConfigError(f"profiles.{name}: {preset.name} takes the prompt {how} "
                          f"(prompt_via = \"{preset.prompt_via}\")")
    env = spec.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise ConfigError(f"profiles.{name}.env must map strings to strings")
    parser = spec.get("parser", preset.parser if preset else "text")
    if parser not in PARSERS:
        raise ConfigError(f"profiles.{name}.parser must be one of {', '.join(PARSERS)}")
    isolation = spec.get("isolation", "none")
    if isolation not in ISOLATIONS:
        raise ConfigError(f"profiles.{name}.isolation must be \"none\" or \"worktree\"")
    approvals = spec.get("approvals", "off")
    if approvals not in APPROVALS:
        raise ConfigError(f"profiles.{name}.approvals must be \"off\" or \"ask\"")
    if approvals == "ask" and not (preset is not None and (preset.asks or preset.live_asks)):
        able = ", ".join(n for n, p in PRESETS.items() if p.asks)
        live = ", ".join(n for n, p in PRESETS.items() if p.live_asks)
        raise ConfigError(f"profiles.{name}: approvals = \"ask\" needs a preset whose CLI takes a per-run "
                          f"permission hook ({able}) or whose live conversation asks ({live})")
    if approvals == "ask" and not preset.asks and argv is not None:
        raise ConfigError(f"profiles.{name}: approvals = \"ask\" asks only in {preset.name}'s live conversation, "
                          "which a profile's own argv does not have")
    if approvals == "ask" and argv is not None and "{binary}" not in argv:
        raise ConfigError(f"profiles.{name}: approvals = \"ask\" needs the element \"{{binary}}\" in argv "
                          "(the per-run settings go right after it)")
    if preset is None:
        able = "none"
    else:
        able = preset.conversation if argv is None else "resume" if preset.resume else "none"
    conversation = spec.get("conversation", able)
    if conversation not in CONVERSATIONS:
        raise ConfigError(f"profiles.{name}.conversation must be \"live\", \"resume\" or \"none\"")
    if CONVERSATIONS.index(conversation) < CONVERSATIONS.index(able):
        raise ConfigError(f"profiles.{name}: conversation = \"{conversation}\" is more than this CLI can do "
                          f"(at most \"{able}\")")
    if argv is not None and "{binary}" not in argv and binary is not None:
        raise ConfigError(f"profiles.{name}: with binary set, argv must contain the element \"{{binary}}\"")
    return Profile(
        name=name,
        argv=tuple(argv) if argv is not None else preset.argv,
        prompt_via=prompt_via,
        env={**(preset.env if preset else {}), **env},
        preset=preset.name if preset else None,
        binary=binary or (preset.name if preset else None),
        extra_args=tuple(extra_args),
        parser=parser,
        resume=preset.resume if preset else None,
        from_preset=argv is None,
        isolation=isolation,
        record=preset.record if preset else None,
        tested_version=preset.tested_version if preset else None,
        approvals=approvals,
        conversation=conversation,
        live_argv=preset.live_argv if preset is not None and argv is None else None,
    )


def load_config(path: str | None) -> WorkerConfig:
    """Read the TOML file at ``path``; None or a missing default file -> no profiles."""
    if path is None:
        return WorkerConfig()
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}")
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}")
    return parse_config(data)


def inside(path: str, root: str) -> bool:
    """True when realpath ``path`` is ``root`` or below it (both already realpath'd)."""
    try:
        return os.path.commonpath([path, root]) == root
    except ValueError:
        return False


class Refusal(str):
    """A refusal's text; ``code`` is its H ``refused_reason`` (None where H has none)."""

    code: str | None = None

    def __new__(cls, text: str, code: str | None = None):
        self = super().__new__(cls, text)
        self.code = code
        return self


def check_start(config: WorkerConfig, payload: dict) -> tuple[Profile, str] | Refusal:
    """W4: the profile and the real folder for a ``start`` payload, or a ``Refusal``
    (text, with ``code`` ``profile_unknown``, ``folder_outside_roots`` or
    ``folder_outside_grant`` where one applies).

    The folder must be absolute, an existing directory, and its realpath must lie inside
    one of the locally allowed roots AND inside the realpath of the message's grant root
    (``..`` and symlinks are resolved first, K4).
    """
    profile = config.profiles.get(payload.get("agent"))
    if profile is None:
        return Refusal(f"unknown agent profile {payload.get('agent')!r} (not in the worker's config)", "profile_unknown")
    folder = payload.get("folder")
    grant_root = payload.get("grant_root")
    if not isinstance(folder, str) or not os.path.isabs(folder):
        return Refusal("folder is not an absolute path")
    if not isinstance(grant_root, str) or not os.path.isabs(grant_root):
        return Refusal("grant root is not an absolute path")
    prompt = payload.get("prompt")
    if not isinstance(prompt, str) or "\x00" in prompt:
        return Refusal("prompt is not a string without NUL")
    real = os.path.realpath(folder)
    if not any(inside(real, root) for root in config.allowed_roots):
        return Refusal(f"folder {real} is outside the worker's allowed roots", "folder_outside_roots")
    if not inside(real, os.path.realpath(grant_root)):
        return Refusal(f"folder {real} is outside the grant root {grant_root}", "folder_outside_grant")
    if not os.path.isdir(real):
        return Refusal(f"folder {real} is not a directory")
    return profile, real
