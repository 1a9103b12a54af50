"""The worker's local configuration (SPEC O4, W4, W7, W8).

TOML file::

    allowed_roots = ["/Users/me/code"]
    max_concurrent = 4          # W8
    prevent_idle_sleep = true   # W7 (macOS only)

    [profiles.claude]
    argv = ["claude", "-p", "{prompt}"]   # "{prompt}" -> the prompt as ONE argument
    prompt_via = "arg"                     # or "stdin"
    env = {FOO = "bar"}

A task's ``agent`` names a profile; nothing else ever runs (W4).
"""
from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field

DEFAULT_MAX_CONCURRENT = 4


class ConfigError(Exception):
    pass


@dataclass(frozen=True)
class Profile:
    name: str
    argv: tuple[str, ...]
    prompt_via: str = "arg"
    env: dict = field(default_factory=dict)

    def command(self, *, prompt: str, folder: str) -> list[str]:
        """The argv to execute: ``{prompt}`` / ``{folder}`` elements replaced whole.

        No shell ever sees it (K4). With ``prompt_via = "stdin"`` a ``{prompt}`` element is
        dropped and the prompt goes on stdin instead.
        """
        out = []
        for element in self.argv:
            if element == "{prompt}":
                if self.prompt_via == "arg":
                    out.append(prompt)
            elif element == "{folder}":
                out.append(folder)
            else:
                out.append(element)
        return out


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
        argv = spec.get("argv")
        if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
            raise ConfigError(f"profiles.{name}.argv must be a non-empty list of strings")
        prompt_via = spec.get("prompt_via", "arg")
        if prompt_via not in ("arg", "stdin"):
            raise ConfigError(f"profiles.{name}.prompt_via must be 'arg' or 'stdin'")
        env = spec.get("env", {})
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise ConfigError(f"profiles.{name}.env must map strings to strings")
        profiles[name] = Profile(name=name, argv=tuple(argv), prompt_via=prompt_via, env=dict(env))
    return WorkerConfig(
        allowed_roots=tuple(os.path.realpath(r) for r in roots),
        profiles=profiles,
        max_concurrent=max_concurrent,
        prevent_idle_sleep=prevent,
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


def check_start(config: WorkerConfig, payload: dict) -> tuple[Profile, str] | str:
    """W4: the profile and the real folder for a ``start`` payload, or a refusal reason.

    The folder must be absolute, an existing directory, and its realpath must lie inside
    one of the locally allowed roots AND inside the realpath of the message's grant root
    (``..`` and symlinks are resolved first, K4).
    """
    profile = config.profiles.get(payload.get("agent"))
    if profile is None:
        return f"unknown agent profile {payload.get('agent')!r} (not in the worker's config)"
    folder = payload.get("folder")
    grant_root = payload.get("grant_root")
    if not isinstance(folder, str) or not os.path.isabs(folder):
        return "folder is not an absolute path"
    if not isinstance(grant_root, str) or not os.path.isabs(grant_root):
        return "grant root is not an absolute path"
    prompt = payload.get("prompt")
    if not isinstance(prompt, str) or "\x00" in prompt:
        return "prompt is not a string without NUL"
    real = os.path.realpath(folder)
    if not any(inside(real, root) for root in config.allowed_roots):
        return f"folder {real} is outside the worker's allowed roots"
    if not inside(real, os.path.realpath(grant_root)):
        return f"folder {real} is outside the grant root {grant_root}"
    if not os.path.isdir(real):
        return f"folder {real} is not a directory"
    return profile, real
