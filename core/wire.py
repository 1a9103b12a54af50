"""The vocabulary of wire shapes (SPEC H, B2; STYLE 9): what the ``TypedDict`` of each shape
in ``*/shapes.py`` is written with, so that one declaration is both the builder's return
type and, through ``core.schema.shape``, the OpenAPI component of that shape.

No DRF here (the shapes modules import this; ``tests/test_structure.py`` checks it):

- ``Uuid``, ``Time``, ``Url``: strings with an OpenAPI ``format`` (``uuid``, ``date-time``
  as ISO-8601 UTC, ``uri``); on the wire they are plain strings; ``iso`` writes a ``Time``;
- ``Doc("...")``: the field's description in the schema, as ``Annotated[T, Doc("...")]``;
- ``X | None``: nullable; ``NotRequired[X]``: a key that may be absent; ``Literal[...]``
  or a ``TextChoices``: an enum; ``list[X]``; a nested ``TypedDict``; ``dict[str, Any]``:
  a free-form object (give it a ``Doc`` saying why it is free-form);
- ``BoardEvent``: the base of every board event shape (``server_time``).
"""
from datetime import datetime
from typing import Annotated, NotRequired, TypedDict


class Format(str):
    """The OpenAPI ``format`` of a string field (``Annotated[str, Format("uuid")]``)."""


class Doc(str):
    """The description of a field in the schema (``Annotated[int, Doc("seconds")]``)."""


Uuid = Annotated[str, Format("uuid")]
Time = Annotated[str, Format("date-time")]  # ISO-8601, UTC in this service
Url = Annotated[str, Format("uri")]


def iso(value: datetime | None) -> str | None:
    """A ``Time``: ISO-8601 of an aware datetime (UTC in this service), or None."""
    return value.isoformat() if value is not None else None


class BoardEvent(TypedDict):
    """What every board event carries besides its own fields (B2): ``server_time``, added
    by ``core.broadcast.broadcast`` when it sends the event (so a builder's result lacks
    it; every event on ``/ws/board/`` has it)."""

    server_time: NotRequired[Annotated[Time, Doc("the service clock when the event was sent (B3)")]]
