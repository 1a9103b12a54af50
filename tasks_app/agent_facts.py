"""The agent facts of a final receipt and of progress (SPEC G1-G5, H), validated and
bounded for storage. Pure functions, no DRF: the API layer turns ``FactsError`` into a
400 (R3: malformed is final), the receipt service stores ``clean_*``'s output.

Shapes (each key optional in a final receipt):

- ``agent_result``: ``{"is_error": bool, "subtype": str <= 100, "summary": str}`` or null;
- ``usage``: ``{"turns", "tool_calls", "input_tokens", "output_tokens": int >= 0 | null,
  "cost_usd": number >= 0 | null}`` or null;
- ``agent_session_id``: str <= 200 or null;
- ``evidence``: ``{"git": {...G5..., and for a worktree task G7's branch, base,
  base_branch, files, diff, truncated}}`` or ``{}``;
- ``refused_reason``: one of ``REFUSED_REASONS``;
- ``entries``: transcript entries (G4, ``clean_entries``), also in a progress post.
"""
from __future__ import annotations

from machine.protocol import (
    ENTRIES_PER_POST,
    ENTRY_KINDS,
    ENTRY_STATUSES,
    ENTRY_TEXT_MAX_BYTES,
    ENTRY_TOOL_MAX_CHARS,
)

REFUSED_REASONS = ("profile_unknown", "folder_outside_roots", "folder_outside_grant", "agent_not_found",
                   "resume_unsupported", "not_a_git_repository", "worktree_unavailable",
                   "resume_unavailable")
USAGE_INTS = ("turns", "tool_calls", "input_tokens", "output_tokens")
USAGE_KEYS = (*USAGE_INTS, "cost_usd")
TEXT_MAX_BYTES = 4096
SESSION_ID_MAX = 200
GIT_INTS = ("commits", "files_changed", "insertions", "deletions", "dirty_count", "start_dirty")
# G7, a worktree task: its branch, the commit it started from (and the branch that commit
# was on, null on a detached HEAD), the files changed and the unified diff (cut, marked).
WORKTREE_KEYS = ("branch", "base", "base_branch", "files", "diff", "truncated")
GIT_KEYS = {"start_head", "end_head", "subjects", "dirty", *GIT_INTS, *WORKTREE_KEYS}
GIT_LIST_MAX = 50
GIT_ITEM_CHARS = 300
DIFF_MAX_BYTES = 256 * 1024
FILES_MAX = 500
FILE_STATUSES = frozenset("ACDMRTUXB")  # git diff --name-status letters
PATH_MAX_CHARS = 1024
REF_MAX_CHARS = 255
BIG = 2**53


class FactsError(ValueError):
    """A malformed agent fact; the message names the field."""


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= BIG


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= BIG


def cap_text(text: str, limit: int = TEXT_MAX_BYTES) -> str:
    data = text.encode("utf-8")
    return text if len(data) <= limit else data[:limit].decode("utf-8", errors="ignore")


def clean_usage(usage) -> dict | None:
    if usage is None:
        return None
    if not isinstance(usage, dict) or set(usage) - set(USAGE_KEYS):
        raise FactsError(f"usage must be null or an object with keys {', '.join(USAGE_KEYS)}")
    out = {}
    for key in USAGE_KEYS:
        value = usage.get(key)
        ok = value is None or (_number(value) if key == "cost_usd" else _int(value))
        if not ok:
            raise FactsError(f"usage.{key} must be a non-negative {'number' if key == 'cost_usd' else 'integer'} or null")
        out[key] = value
    return out


def clean_agent_result(result) -> dict | None:
    if result is None:
        return None
    if not isinstance(result, dict) or set(result) - {"is_error", "subtype", "summary"}:
        raise FactsError("agent_result must be null or {is_error, subtype, summary}")
    if not isinstance(result.get("is_error"), bool):
        raise FactsError("agent_result.is_error must be true or false")
    subtype, summary = result.get("subtype", ""), result.get("summary", "")
    if not isinstance(subtype, str) or len(subtype) > 100:
        raise FactsError("agent_result.subtype must be a string of at most 100 characters")
    if not isinstance(summary, str):
        raise FactsError("agent_result.summary must be a string")
    return {"is_error": result["is_error"], "subtype": subtype, "summary": cap_text(summary)}


def clean_git(git) -> dict:
    if not isinstance(git, dict) or set(git) - GIT_KEYS:
        raise FactsError(f"evidence.git must be an object with keys among {', '.join(sorted(GIT_KEYS))}")
    out = {}
    for key in ("start_head", "end_head"):
        value = git.get(key)
        if value is not None and (not isinstance(value, str) or len(value) > 64):
            raise FactsError(f"evidence.git.{key} must be a commit id or null")
        out[key] = value
    for key in GIT_INTS:
        value = git.get(key)
        if value is not None and not _int(value):
            raise FactsError(f"evidence.git.{key} must be a non-negative integer or null")
        out[key] = value
    for key in ("subjects", "dirty"):
        value = git.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise FactsError(f"evidence.git.{key} must be a list of strings")
        out[key] = [v[:GIT_ITEM_CHARS] for v in value[:GIT_LIST_MAX]]
    if any(key in git for key in WORKTREE_KEYS):
        out.update(clean_worktree_git(git))
    return out


def _ref(value, name: str, *, nullable: bool) -> str | None:
    if value is None and nullable:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= REF_MAX_CHARS or any(ord(c) < 0x20 for c in value):
        raise FactsError(f"evidence.git.{name} must be a branch name{' or null' if nullable else ''}")
    return value


def _file(entry) -> dict:
    if not isinstance(entry, dict) or set(entry) - {"path", "old_path", "status", "insertions", "deletions"}:
        raise FactsError("evidence.git.files items must be {path, status, insertions, deletions, old_path?}")
    out = {}
    for key in ("path", "old_path"):
        value = entry.get(key)
        if key == "old_path" and value is None:
            continue
        if not isinstance(value, str) or not 0 < len(value) <= PATH_MAX_CHARS:
            raise FactsError(f"evidence.git.files {key} must be a path of 1-{PATH_MAX_CHARS} characters")
        out[key] = value
    if entry.get("status") not in FILE_STATUSES:
        raise FactsError(f"evidence.git.files status must be one of {''.join(sorted(FILE_STATUSES))}")
    out["status"] = entry["status"]
    for key in ("insertions", "deletions"):
        value = entry.get(key)
        if value is not None and not _int(value):
            raise FactsError(f"evidence.git.files {key} must be a non-negative integer or null (binary)")
        out[key] = value
    return out


def clean_worktree_git(git: dict) -> dict:
    """G7 keys of ``evidence.git``: ``branch`` (str), ``base`` (commit id),
    ``base_branch`` (str or null: detached), ``files`` (at most ``FILES_MAX`` of
    ``{path, status, insertions, deletions, old_path?}``), ``diff`` (unified, at most
    ``DIFF_MAX_BYTES`` UTF-8 bytes) and ``truncated`` (bool). Raises ``FactsError``;
    nothing is cut here: a worker sends them bounded."""
    base = git.get("base")
    if not isinstance(base, str) or not 4 <= len(base) <= 64 or any(c not in "0123456789abcdef" for c in base):
        raise FactsError("evidence.git.base must be a commit id")
    files = git.get("files", [])
    if not isinstance(files, list) or len(files) > FILES_MAX:
        raise FactsError(f"evidence.git.files must be a list of at most {FILES_MAX} files")
    diff = git.get("diff", "")
    if not isinstance(diff, str) or len(diff.encode("utf-8", errors="replace")) > DIFF_MAX_BYTES:
        raise FactsError(f"evidence.git.diff must be a string of at most {DIFF_MAX_BYTES} bytes")
    truncated = git.get("truncated", False)
    if not isinstance(truncated, bool):
        raise FactsError("evidence.git.truncated must be true or false")
    return {"branch": _ref(git.get("branch"), "branch", nullable=False), "base": base,
            "base_branch": _ref(git.get("base_branch"), "base_branch", nullable=True),
            "files": [_file(f) for f in files], "diff": diff, "truncated": truncated}


def clean_evidence(evidence) -> dict:
    if evidence is None:
        return {}
    if not isinstance(evidence, dict) or set(evidence) - {"git"}:
        raise FactsError("evidence must be an object with an optional git")
    return {"git": clean_git(evidence["git"])} if evidence.get("git") is not None else {}


ENTRY_KEYS = {"n", "kind", "text", "tool", "status", "call", "usage", "seq"}
ENTRY_USAGE_KEYS = {"input_tokens", "output_tokens"}


def _text(value, limit_bytes: int) -> bool:
    """A string of at most ``limit_bytes`` of UTF-8 that PostgreSQL can store (no NUL, no
    lone surrogate)."""
    if not isinstance(value, str) or "\x00" in value:
        return False
    try:
        return len(value.encode("utf-8")) <= limit_bytes
    except UnicodeEncodeError:
        return False


def clean_entry(entry) -> dict:
    """One G4 transcript entry ``{n, kind, text, tool?, status?, call?, usage?, seq?}``:
    ``n`` and ``call`` integers >= 1, ``seq`` (a ``prompt`` entry only: the live
    conversation's message whose turn it opens, C2) an integer >= 0, ``kind`` one of
    ``ENTRY_KINDS``, ``text`` at most
    ``ENTRY_TEXT_MAX_BYTES`` of UTF-8, ``tool`` at most ``ENTRY_TOOL_MAX_CHARS``,
    ``status`` one of ``ENTRY_STATUSES``, ``usage`` ``{input_tokens, output_tokens}``
    (non-negative integers or null). Over a bound is refused, not cut (K3). Raises
    ``FactsError``."""
    if not isinstance(entry, dict) or set(entry) - ENTRY_KEYS or not {"n", "kind", "text"} <= set(entry):
        raise FactsError("entries items must be {n, kind, text, tool?, status?, call?, usage?, seq?}")
    if not _int(entry["n"]) or entry["n"] < 1:
        raise FactsError("entries n must be an integer >= 1")
    if entry["kind"] not in ENTRY_KINDS:
        raise FactsError(f"entries kind must be one of {', '.join(ENTRY_KINDS)}")
    if not _text(entry["text"], ENTRY_TEXT_MAX_BYTES):
        raise FactsError(f"entries text must be a string of at most {ENTRY_TEXT_MAX_BYTES} bytes of UTF-8, no NUL")
    out = {"n": entry["n"], "kind": entry["kind"], "text": entry["text"]}
    if "tool" in entry:
        if not _text(entry["tool"], 4 * ENTRY_TOOL_MAX_CHARS) or not 0 < len(entry["tool"]) <= ENTRY_TOOL_MAX_CHARS:
            raise FactsError(f"entries tool must be a string of 1-{ENTRY_TOOL_MAX_CHARS} characters")
        out["tool"] = entry["tool"]
    if "status" in entry:
        if entry["status"] not in ENTRY_STATUSES:
            raise FactsError(f"entries status must be one of {', '.join(ENTRY_STATUSES)}")
        out["status"] = entry["status"]
    if "call" in entry:
        if not _int(entry["call"]) or not 1 <= entry["call"] < entry["n"]:
            raise FactsError("entries call must be the n of an earlier entry")
        out["call"] = entry["call"]
    if "usage" in entry:
        usage = entry["usage"]
        if not isinstance(usage, dict) or set(usage) != ENTRY_USAGE_KEYS or \
                not all(v is None or _int(v) for v in usage.values()):
            raise FactsError("entries usage must be {input_tokens, output_tokens}, each a non-negative integer or null")
        out["usage"] = {"input_tokens": usage["input_tokens"], "output_tokens": usage["output_tokens"]}
    if "seq" in entry:
        if entry["kind"] != "prompt" or not _int(entry["seq"]):
            raise FactsError("entries seq must be an integer >= 0, on a prompt entry only")
        out["seq"] = entry["seq"]
    return out


def clean_entries(entries) -> list[dict]:
    """G4: a list of at most ``ENTRIES_PER_POST`` entries (``clean_entry``) in rising
    ``n``. Raises ``FactsError``."""
    if not isinstance(entries, list) or len(entries) > ENTRIES_PER_POST:
        raise FactsError(f"entries must be a list of at most {ENTRIES_PER_POST} entries")
    out = [clean_entry(e) for e in entries]
    if any(b["n"] <= a["n"] for a, b in zip(out, out[1:])):
        raise FactsError("entries must be in rising n")
    return out


def clean_agent_facts(facts: dict) -> dict:
    """Validate the G keys of final facts; returns them bounded for the task row:
    ``{agent_result, usage, agent_session_id, evidence, entries}``. Raises ``FactsError``."""
    session = facts.get("agent_session_id")
    if session is not None and (not isinstance(session, str) or not 0 < len(session) <= SESSION_ID_MAX):
        raise FactsError(f"agent_session_id must be a string of 1-{SESSION_ID_MAX} characters or null")
    refused = facts.get("refused_reason")
    if refused is not None and refused not in REFUSED_REASONS:
        raise FactsError(f"refused_reason must be one of {', '.join(REFUSED_REASONS)}")
    return {
        "agent_result": clean_agent_result(facts.get("agent_result")),
        "usage": clean_usage(facts.get("usage")),
        "agent_session_id": session,
        "evidence": clean_evidence(facts.get("evidence")),
        "entries": clean_entries(facts.get("entries", [])),
    }


def describe_git(git: dict | None) -> str:
    """One line for people (U4, B9): "2 commits, 5 files changed (+10 -3), 1 dirty path"."""
    if not git:
        return "no git evidence"
    parts = []
    commits = git.get("commits")
    if commits is not None:
        parts.append(f"{commits} commit{'s' if commits != 1 else ''}")
    files = git.get("files_changed") or 0
    parts.append(f"{files} file{'s' if files != 1 else ''} changed since the task started"
                 f" (+{git.get('insertions') or 0} -{git.get('deletions') or 0})")
    dirty = git.get("dirty_count") or 0
    if dirty:
        parts.append(f"{dirty} uncommitted path{'s' if dirty != 1 else ''}")
    return ", ".join(parts)
