"""``worker --check`` (SPEC G1): every profile as the worker will run it."""
from __future__ import annotations

import json

from .config import WorkerConfig


def check_profiles(config: WorkerConfig, *, path: str | None) -> tuple[str, bool]:
    """A readable report of every profile and whether all are runnable.

    A profile is broken when its executable is not found (on ``path``, a PATH string, or
    at its absolute ``binary``). Returns ``(text, ok)``.
    """
    lines = [f"allowed_roots: {json.dumps(list(config.allowed_roots))}"]
    ok = True
    if not config.profiles:
        lines.append("no profiles: this worker runs nothing (add [profiles.NAME] tables)")
        ok = False
    if not config.allowed_roots:
        lines.append("no allowed_roots: every task folder will be refused")
    for name, profile in sorted(config.profiles.items()):
        found = profile.find_binary(path)
        info = profile.describe()
        state = f"found at {found}" if found else "NOT FOUND"
        if not found:
            ok = False
        lines.append(f"[profiles.{name}]  {'BROKEN' if not found else 'ok'}")
        lines.append(f"  preset:     {info['preset'] or '-'}")
        lines.append(f"  parser:     {info['parser']}")
        lines.append(f"  binary:     {info['binary']} ({state})")
        lines.append(f"  argv:       {json.dumps(profile.command(prompt='{prompt}', folder='{folder}', binary=found))}")
        lines.append(f"  prompt_via: {info['prompt_via']}")
        lines.append(f"  resume:     {json.dumps(info['resume']) if info['resume'] is not None else 'unsupported'}")
        if info["env"]:
            lines.append(f"  env:        {', '.join(info['env'])}")
    return "\n".join(lines) + "\n", ok
