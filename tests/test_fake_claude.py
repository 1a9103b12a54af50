"""The demo's fake Claude Code (scripts/fake_claude.py) speaks the stream the claude
parser reads, resumes the session it is given, and commits in the demo repository (G2,
G5, G6, O1), through the same argv, spawn and parser as the worker."""
import json
import os
import subprocess
from pathlib import Path

import pytest

from machine.worker import process
from machine.worker.config import parse_profile
from machine.worker.git_evidence import git_end, git_start
from machine.worker.parsers import make_parser

pytestmark = pytest.mark.backend_independent  # neither database nor layer (pytest.ini)

BASE_DIR = Path(__file__).resolve().parent.parent
FAKE = BASE_DIR / "scripts" / "fake_claude.py"


def run(tmp_path, repo, prompt, env, session=None, name="op"):
    profile = parse_profile("demo", {"preset": "claude", "binary": str(FAKE)})
    op_dir = tmp_path / name
    op_dir.mkdir()
    argv = profile.command(prompt=prompt, folder=str(repo), agent_session_id=session)
    proc, _ = process.spawn(argv=argv, cwd=str(repo), env={**os.environ, **env}, op_dir=str(op_dir), stdin_text=None)
    code = proc.wait(timeout=60)
    parser = make_parser(profile.parser)
    parser.feed((op_dir / "output.log").read_bytes())
    parser.close()
    return code, parser.facts()


def test_o1_fake_claude_stream_commits_and_resumes(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@e", "commit", "-q",
                    "--allow-empty", "-m", "root"], check=True)
    record = tmp_path / "record.jsonl"
    env = {"FAKE_CLAUDE_PAUSE_S": "0", "FAKE_CLAUDE_TURNS": "3", "FAKE_CLAUDE_RECORD": str(record)}
    start = git_start(str(repo))
    code, facts = run(tmp_path, repo, "fix the failing test", env)
    assert code == 0
    assert facts["agent_result"] == {"is_error": False, "subtype": "success",
                                     "summary": "Done: 'fix the failing test' is handled; I committed my notes."}
    assert facts["usage"]["turns"] == 3 and facts["usage"]["tool_calls"] == 2
    assert facts["usage"]["cost_usd"] > 0 and facts["usage"]["input_tokens"] > 0
    evidence = git_end(str(repo), start)
    assert evidence["commits"] == 2 and evidence["files_changed"] == 1 and evidence["dirty"] == []

    code, again = run(tmp_path, repo, "and the docs", env, session=facts["agent_session_id"], name="op2")
    assert code == 0 and again["agent_session_id"] == facts["agent_session_id"]
    second = json.loads(record.read_text().splitlines()[1])["argv"]
    assert second[second.index("--resume") + 1] == facts["agent_session_id"]


def test_g3_fake_claude_api_error_exits_zero_with_is_error(tmp_path):
    code, facts = run(tmp_path, tmp_path, "x", {"FAKE_CLAUDE_PAUSE_S": "0", "FAKE_CLAUDE_RESULT": "api_error"})
    assert code == 0
    assert facts["agent_result"]["is_error"] is True and facts["agent_result"]["subtype"] == "api_error"


def test_g1_fake_claude_version_answers_and_runs_nothing(tmp_path):
    """``worker --check`` asks every preset CLI for ``--version``: the demo's fake answers
    the version whose stream it speaks and neither writes nor commits (it used to run a
    turn and commit into whatever folder the check ran in)."""
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    answer = subprocess.run([str(FAKE), "--version"], cwd=repo, capture_output=True, text=True, timeout=30)
    assert answer.returncode == 0 and answer.stdout.startswith("2.1.328 "), answer
    assert list(repo.iterdir()) == [repo / ".git"]
    assert subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", "-q", "HEAD"]).returncode != 0  # no commit
