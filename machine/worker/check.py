"""``worker --check`` (SPEC G1): every profile as the worker will run it."""
from __future__ import annotations

import json
import os
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor

from .config import Profile, WorkerConfig

# A CLI that hangs on `--version` (a first-run prompt, a network call) must not hang the
# check: each answer is awaited this long at most (Gemini CLI 0.61.0 takes ~3 s on 2 busy cores).
VERSION_TIMEOUT_S = 30.0
_VERSION = re.compile(r"(?<![\d.])(\d+\.\d+\.\d+(?:[-+][0-9A-Za-z.-]*[0-9A-Za-z])?)")


def cli_version(binary: str, *, env: dict | None = None, timeout_s: float = VERSION_TIMEOUT_S) -> tuple[str | None, str]:
    """G1: run ``binary --version`` (no shell, stdin closed) and read its version.

    Returns ``(version, note)``: ``version`` is the first ``X.Y.Z`` (with an optional
    pre-release or build suffix) on stdout, else on stderr (``codex-cli 0.169.0``,
    ``2.1.328 (Claude Code)``, ``aider 0.86.2`` all read as the bare number), or None with
    ``note`` saying why (exit status, timeout, nothing version-like). ``env`` is the whole
    environment for the run (None: this process's).
    """
    try:
        done = subprocess.run([binary, "--version"], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              errors="replace", env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None, f"`--version` gave no answer within {timeout_s:g} s"
    except OSError as exc:
        return None, f"`--version` could not run: {exc.strerror or exc}"
    for stream in (done.stdout, done.stderr):
        found = _VERSION.search(stream or "")
        if found and done.returncode == 0:
            return found.group(1), ""
    last = (done.stderr or done.stdout or "").strip().splitlines()[-1:] or [""]
    return None, f"`--version` exited {done.returncode}: {last[0][:200]}"


def _version_line(profile: Profile, found: str | None, answer: tuple[str | None, str] | None) -> tuple[str, bool]:
    """The ``version:`` line of one profile and whether it carries a warning."""
    tested = profile.tested_version
    if found is None or answer is None:
        return f"-  (tested: {tested or '-'})", False
    version, note = answer
    if version is None:
        return f"unknown  WARNING: {note}; the preset was tested with {tested}", True
    if tested is None:
        return f"{version}  (no preset: no tested version)", False
    if version != tested:
        return (f"{version}  WARNING: differs from the tested {tested} (scripts/install_agent_clis.sh pins it; "
                f"the preset's flags, stream and exit codes were proven only there)"), True
    return f"{version}  (tested: {tested})", False


def check_profiles(config: WorkerConfig, *, path: str | None, probe_versions: bool = True) -> tuple[str, bool]:
    """A readable report of every profile and whether all are runnable.

    A profile is broken when its executable is not found (on ``path``, a PATH string, or
    at its absolute ``binary``). Each preset profile whose binary is found is asked for
    ``--version`` (in parallel, ``VERSION_TIMEOUT_S`` each, with the profile's ``env``
    over this process's), shown beside the preset's ``tested_version``; a different or
    unreadable version is a WARNING line, never a broken profile (G1). Returns
    ``(text, ok)``.
    """
    lines = [f"allowed_roots: {json.dumps(list(config.allowed_roots))}"]
    ok = True
    if not config.profiles:
        lines.append("no profiles: this worker runs nothing (add [profiles.NAME] tables)")
        ok = False
    if not config.allowed_roots:
        lines.append("no allowed_roots: every task folder will be refused")
    profiles = sorted(config.profiles.items())
    found_at = {name: profile.find_binary(path) for name, profile in profiles}
    probes = {name: (found_at[name], profile) for name, profile in profiles
              if probe_versions and found_at[name] and profile.preset}
    answers: dict = {}
    if probes:
        base_env = {**os.environ, **({"PATH": path} if path is not None else {})}
        with ThreadPoolExecutor(max_workers=len(probes)) as pool:
            futures = {name: pool.submit(cli_version, binary, env={**base_env, **profile.env})
                       for name, (binary, profile) in probes.items()}
            answers = {name: future.result() for name, future in futures.items()}
    warnings = []
    for name, profile in profiles:
        found = found_at[name]
        info = profile.describe()
        state = f"found at {found}" if found else "NOT FOUND"
        if not found:
            ok = False
        version, warned = _version_line(profile, found, answers.get(name))
        if warned:
            warnings.append(name)
        lines.append(f"[profiles.{name}]  {'BROKEN' if not found else 'ok'}")
        lines.append(f"  preset:     {info['preset'] or '-'}")
        lines.append(f"  parser:     {info['parser']}")
        lines.append(f"  binary:     {info['binary']} ({state})")
        if profile.preset:
            lines.append(f"  version:    {version}")
        lines.append(f"  argv:       {json.dumps(profile.command(prompt='{prompt}', folder='{folder}', binary=found))}")
        lines.append(f"  prompt_via: {info['prompt_via']}")
        if profile.approvals != "ask":
            asks = ""
        elif profile.asks_through_settings():
            asks = " (the owner answers: PermissionRequest hook through --settings, Q5)"
        else:
            asks = " (the owner answers in live conversations: the bridge asks, Q5; headless runs reject)"
        lines.append(f"  approvals:  {profile.approvals}{asks}")
        lines.append(f"  resume:     {json.dumps(info['resume']) if info['resume'] is not None else 'unsupported'}")
        if info["env"]:
            lines.append(f"  env:        {', '.join(info['env'])}")
    if warnings:
        lines.append(f"WARNING: {len(warnings)} profile(s) run a CLI version other than the preset's tested one: "
                     f"{', '.join(warnings)}")
    return "\n".join(lines) + "\n", ok
