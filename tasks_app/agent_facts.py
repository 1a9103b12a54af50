"""The agent facts of a final receipt and of progress (SPEC G1-G5, H), validated and
bounded for storage. Pure functions, no DRF: the API layer turns ``FactsError`` into a
400 (R3: malformed is final), the receipt service stores ``clean_*``'s output.

Shapes (each key optional in a final receipt):

- ``agent_result``: ``{"is_error": bool, "subtype": str <= 100, "summary": str}`` or null;
- ``usage``: ``{"turns", "tool_calls", "input_tokens", "output_tokens": int >= 0 | null,
  "cost_usd": number >= 0 | null}`` or null;
- ``agent_session_id``: str <= 200 or null;
- ``evidence``: ``{"git": {...G5...}}`` or ``{}``;
- ``refused_reason``: one of ``REFUSED_REASONS``.
"""
from __future__ import annotations

REFUSED_REASONS = ("profile_unknown", "folder_outside_roots", "folder_outside_grant", "agent_not_found",
                   "resume_unsupported")
USAGE_INTS = ("turns", "tool_calls", "input_tokens", "output_tokens")
USAGE_KEYS = (*USAGE_INTS, "cost_usd")
TEXT_MAX_BYTES = 4096
SESSION_ID_MAX = 200
GIT_INTS = ("commits", "files_changed", "insertions", "deletions", "dirty_count", "start_dirty")
GIT_KEYS = {"start_head", "end_head", "subjects", "dirty", *GIT_INTS}
GIT_LIST_MAX = 50
GIT_ITEM_CHARS = 300
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
    return out


def clean_evidence(evidence) -> dict:
    if evidence is None:
        return {}
    if not isinstance(evidence, dict) or set(evidence) - {"git"}:
        raise FactsError("evidence must be an object with an optional git")
    return {"git": clean_git(evidence["git"])} if evidence.get("git") is not None else {}


def clean_agent_facts(facts: dict) -> dict:
    """Validate the G keys of final facts; returns them bounded for the task row:
    ``{agent_result, usage, agent_session_id, evidence}``. Raises ``FactsError``."""
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
    }
