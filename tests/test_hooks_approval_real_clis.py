"""SPEC Q8 (interactive), Q3, Q4 with the real agent CLIs offline under tmux. Claude Code: the
hooks installed by ``install_hooks claude`` into a temporary HOME, the fake Messages API
asking for a Bash call, ``--permission-mode manual`` (interactive sessions default to
auto mode, where the model's classifier decides). The CLI's dialog shows while the
approval is pending; answered from the API, the tool runs and the screen says the hook
allowed it; answered in the terminal, the approval ends ``answered_in_terminal`` and the
waiting hook process is gone within 5 s (the CLI itself does not stop it). Codex: its
TUI's PermissionRequest hook, allowed and denied from the API."""
import json
import os
import time
import uuid
from pathlib import Path

import httpx
import pytest

from machine.hooks.install import install
from sessions_app.models import Approval
from tests.agent_clis import cli_bin, offline
from tests.claude_cli import claude_bin, claude_env, fake_model_api  # noqa: F401
from machine.protocol import HOOK_SCRIPT
from tests.hooks_support import BASE_DIR, stop_sender
from tests.live import live_daphne  # noqa: F401
from tests.model_apis import ResponsesAPI
from tests.tmux import Terminal
from tests.wait import wait_for

pytestmark = [pytest.mark.surface, pytest.mark.slow, pytest.mark.django_db(transaction=True)]
DIALOG = "Do you want to proceed?"


HOOK_SCRIPT_BYTES = os.path.join(str(BASE_DIR), *HOOK_SCRIPT).encode()


def hook_pids(state_dir: Path) -> list[int]:
    """The running hook processes of ``state_dir`` (``python -m machine.hooks AGENT``
    or the script by its path as installed; not its sender), found in /proc by their
    command line and environment."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if (b"machine.hooks" in argv or HOOK_SCRIPT_BYTES in argv) and f"RUNSTEAD_HOOK_DIR={state_dir}".encode() in environ:
            found.append(int(entry.name))
    return found


def pending(owner, tool_command: str) -> Approval | None:
    return Approval.objects.filter(owner=owner, state="pending", tool_input__command=tool_command).first()



def _close(term, state_dir) -> None:
    """Close the terminal, stop the sender and kill any hook still waiting."""
    term.close()
    stop_sender(state_dir)
    for pid in hook_pids(state_dir):
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass

def test_q8_real_claude_interactive_dialog_answered_from_the_api_then_in_the_terminal(
        live_daphne, make_owner, fake_model_api, tmp_path):  # noqa: F811
    owner = make_owner()
    token = owner.auth_token.key
    url = live_daphne()
    home, work, state_dir = tmp_path / "home", tmp_path / "work", tmp_path / "home" / ".runstead" / "hooks"
    work.mkdir(parents=True)
    (home / ".claude").mkdir(parents=True)
    # first-run screens skipped: onboarding, the custom API key, the folder's trust
    (home / ".claude.json").write_text(json.dumps({
        "hasCompletedOnboarding": True, "customApiKeyResponses": {"approved": ["sk-test-offline"], "rejected": []},
        "projects": {str(work): {"hasTrustDialogAccepted": True}}}))
    report = install("claude", server=url, token=token, config_dir=home / ".claude", state_dir=state_dir)
    assert any("settings.json: created" in line for line in report.lines())
    settings = json.loads((home / ".claude" / "settings.json").read_text())
    assert settings["hooks"]["PermissionRequest"][0]["hooks"][0]["timeout"] == 630
    env = claude_env(home=home, api=fake_model_api, extra={"RUNSTEAD_HOOK_SENDER_IDLE_S": "10",
                                                           "TERM": "xterm-256color"})
    env = {k: v for k, v in env.items() if k in ("PATH", "LANG", "LC_ALL") or k.startswith(
        ("HOME", "ANTHROPIC_", "CLAUDE_", "DISABLE_", "IS_SANDBOX", "RUNSTEAD_", "TERM"))}
    headers = {"Authorization": f"Token {token}"}
    term = Terminal(tmp_path / "tmux.sock", [claude_bin(), "--permission-mode", "manual"], env=env, cwd=work)
    try:
        term.wait_for("manual mode on", timeout=90)

        # 1. Answered from the API (the phone): the dialog closes, the tool runs.
        term.submit("[[bash:echo from-the-phone > phone.txt]]", accepted=lambda: "Running it." in term.screen().split("[[bash:echo from-the-phone > phone.txt]]")[-1])
        approval = wait_for(lambda: pending(owner, "echo from-the-phone > phone.txt"), timeout_s=60)
        term.wait_for(DIALOG)
        approval.refresh_from_db()
        assert approval.state == "pending"  # the dialog shows while the approval is pending
        assert (approval.agent, approval.tool_name, approval.cwd) == ("claude", "Bash", str(work))
        assert approval.session.attention == "approval"
        decided = httpx.post(f"{url}/api/approvals/{approval.pk}/decision/", json={"behavior": "allow"},
                             headers={**headers, "Idempotency-Key": str(uuid.uuid4())}, timeout=20)
        assert decided.status_code == 200, decided.text
        screen = term.wait_for("Allowed by PermissionRequest hook")
        wait_for(lambda: (work / "phone.txt").exists(), timeout_s=30)
        assert (work / "phone.txt").read_text() == "from-the-phone\n"
        term.wait_for("done.")
        assert DIALOG not in term.screen(), screen

        # 2. Answered in the terminal: the tool runs, the hook that still waits is told.
        term.submit("[[bash:echo from-the-terminal > desk.txt]]", accepted=lambda: "Running it." in term.screen().split("[[bash:echo from-the-terminal > desk.txt]]")[-1])
        approval = wait_for(lambda: pending(owner, "echo from-the-terminal > desk.txt"), timeout_s=60)
        term.wait_for(DIALOG)
        waiting = wait_for(lambda: hook_pids(state_dir), timeout_s=20)
        term.press("Enter", accepted=lambda: DIALOG not in term.screen(), settle_s=3)  # "1. Yes"
        answered = time.monotonic()
        wait_for(lambda: (work / "desk.txt").exists(), timeout_s=30)
        wait_for(lambda: Approval.objects.get(pk=approval.pk).state == "answered_in_terminal", timeout_s=20)
        approval.refresh_from_db()
        assert approval.decided_by == "terminal"
        wait_for(lambda: not any(pid in hook_pids(state_dir) for pid in waiting), timeout_s=20)
        gone = time.monotonic() - answered
        assert gone < 5.0, f"the waiting hook ran on {gone:.1f} s after the terminal answered"
        approval.session.refresh_from_db()
        assert approval.session.attention == ""
        assert Approval.objects.filter(owner=owner).count() == 2
    finally:
        _close(term, state_dir)


def test_q3_real_codex_tui_permission_request_waits_for_the_owner_allow_then_deny(live_daphne, make_owner,  # noqa: F811
                                                                                  tmp_path):
    """Codex 0.169.0 has a ``PermissionRequest`` hook: its TUI with ``-a on-request`` runs
    it when the model asks to run a command outside the sandbox, showing "Running hook"
    (not its dialog: that opens only after a hook that decided nothing), and takes
    ``decision.behavior`` allow or deny (with ``message``). Hooks run once trusted; here
    ``--dangerously-bypass-hook-trust`` trusts them for the run."""
    owner = make_owner()
    token = owner.auth_token.key
    url = live_daphne()
    home, work, state_dir = tmp_path / "home", tmp_path / "work", tmp_path / "home" / ".runstead" / "hooks"
    work.mkdir(parents=True)
    headers = {"Authorization": f"Token {token}"}
    with ResponsesAPI() as api:
        setup = offline("codex", home, api)
        install("codex", server=url, token=token, config_dir=home / ".codex", state_dir=state_dir)
        env = {**setup.env, "PATH": os.environ["PATH"], "TERM": "xterm-256color", "RUNSTEAD_HOOK_SENDER_IDLE_S": "10"}
        argv = [cli_bin("codex"), "--no-daemon", "--dangerously-bypass-hook-trust", "-a", "on-request", "-s", "read-only",
                "[[bash_ask:echo from-the-phone > phone.txt]]"]
        term = Terminal(tmp_path / "tmux.sock", argv, env=env, cwd=work)
        try:
            approval = wait_for(lambda: pending(owner, "echo from-the-phone > phone.txt"), timeout_s=90)
            assert (approval.agent, approval.tool_name, approval.cwd) == ("codex", "Bash", str(work))
            assert approval.key.startswith("codex:") and approval.session.attention == "approval"
            term.wait_for("Running hook")  # the CLI waits for the hook, no dialog meanwhile
            assert not (work / "phone.txt").exists()
            decided = httpx.post(f"{url}/api/approvals/{approval.pk}/decision/", json={"behavior": "allow"},
                                 headers={**headers, "Idempotency-Key": str(uuid.uuid4())}, timeout=20)
            assert decided.status_code == 200, decided.text
            try:
                wait_for(lambda: (work / "phone.txt").exists(), timeout_s=60)  # outside the read-only sandbox
            except AssertionError:
                raise AssertionError(f"no phone.txt; screen:\n{term.screen()}\nhook log: "
                                     f"{(state_dir / 'hook.log').read_text() if (state_dir / 'hook.log').exists() else ''}")
            term.wait_for("done.")

            term.submit("[[bash_ask:echo nope > nope.txt]]", accepted=lambda: "Working" in term.screen())
            approval = wait_for(lambda: pending(owner, "echo nope > nope.txt"), timeout_s=60)
            decided = httpx.post(f"{url}/api/approvals/{approval.pk}/decision/",
                                 json={"behavior": "deny", "message": "Not now: open a branch first"},
                                 headers={**headers, "Idempotency-Key": str(uuid.uuid4())}, timeout=20)
            assert decided.status_code == 200, decided.text
            # the agent's next model request carries the owner's words as the call's output
            wait_for(lambda: any("Not now: open a branch first" in json.dumps(body) for _, body in api.requests),
                       timeout_s=60)
            assert not (work / "nope.txt").exists()
            assert "Would you like to run the following command?" not in term.screen()
        finally:
            _close(term, state_dir)
