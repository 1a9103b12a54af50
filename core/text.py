"""Control characters in text a person wrote or an agent printed (SPEC C7, T2, B9).

One rule, used wherever text must not carry them: a message to an agent is refused when
it holds one (C7, T2: 400 ``invalid``), and a terminal client strips or escapes them
before printing (``tasks_app/follow.py``). The characters are C0 but tab and newline,
DEL, C1, and the Unicode bidi controls (ALM U+061C, LRM and RLM U+200E/U+200F, the
embeddings and overrides U+202A-U+202E, the isolates U+2066-U+2069): ESC starts an escape
sequence a terminal obeys, BEL rings, CR rewrites a line, a U+202E shows "txet" as "text".
No Django, no DRF: a plain pattern and a plain function.
"""
import re

CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def control_character(text: str) -> str | None:
    """The first control character of ``text`` (module docstring) as ``U+XXXX``, or None
    when it has none."""
    found = CONTROL.search(text)
    return None if found is None else f"U+{ord(found.group()):04X}"
