"""The one pagination of every API list (B11, K3): a keyset cursor, newest first, ties
broken by id.

A page is ``{"results": [...], "next": "<absolute URL>" | null}``. Rows are ordered by
(``created_at`` descending, ``id`` descending), a total order, so paging never skips or
repeats a row even when many rows share one ``created_at``; a row created after the first
page was read appears on no later page (it sorts before the cursor). ``?limit=N`` takes
1-100 (default 50); ``?cursor=`` is the opaque value of a ``next`` link. A bad limit or
cursor answers 400 (``invalid`` / ``invalid_cursor``).
"""
import base64
import binascii
import json
import uuid
from datetime import datetime

from django.db.models import Q
from rest_framework import serializers
from rest_framework.pagination import BasePagination
from rest_framework.response import Response
from rest_framework.utils.urls import replace_query_param

from core.errors import ApplicationError
from core.strict import QueryIntegerField, StrictQuerySerializer, valid_query

DEFAULT_LIMIT = 50
MAX_LIMIT = 100
CURSOR_MAX_CHARS = 200


class PageQuery(StrictQuerySerializer):
    """Query parameters of every list: ``cursor`` and ``limit`` (B11). Lists with filters
    subclass it, so the paginator and the view agree on what is known."""

    cursor = serializers.CharField(required=False, max_length=CURSOR_MAX_CHARS, help_text="the opaque cursor of a next link")
    limit = QueryIntegerField(
        required=False, min_value=1, max_value=MAX_LIMIT, help_text=f"page size, 1-{MAX_LIMIT}, default {DEFAULT_LIMIT}"
    )


def encode_cursor(created_at: datetime, row_id: uuid.UUID) -> str:
    """The cursor after a row: URL-safe base64 of ``[created_at ISO-8601, id]``."""
    raw = json.dumps([created_at.isoformat(), str(row_id)], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, uuid.UUID]:
    """Inverse of ``encode_cursor``; raises ApplicationError 400 ``invalid_cursor``."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        created_at, row_id = json.loads(raw)
        at = datetime.fromisoformat(created_at)
        if at.tzinfo is None:
            raise ValueError("naive time")
        return at, uuid.UUID(row_id)
    except (binascii.Error, ValueError, TypeError, UnicodeDecodeError):
        raise ApplicationError("invalid_cursor", "cursor is not one this service issued", status_code=400)


class StableCursorPagination(BasePagination):
    """Keyset pagination on (``-created_at``, ``-id``) for every list of both apps (B11).

    The view's query serializer (``view.query_serializer_class``, default ``PageQuery``)
    validates the whole query string, filters included, so an unknown parameter is refused
    here as well as in the view (K3)."""

    def paginate_queryset(self, queryset, request, view=None):
        query_class = getattr(view, "query_serializer_class", PageQuery)
        params = valid_query(query_class, request)
        limit = params.get("limit", DEFAULT_LIMIT)
        queryset = queryset.order_by("-created_at", "-id")
        if params.get("cursor"):
            at, row_id = decode_cursor(params["cursor"])
            queryset = queryset.filter(Q(created_at__lt=at) | Q(created_at=at, id__lt=row_id))
        rows = list(queryset[: limit + 1])
        self.request = request
        self.next_cursor = encode_cursor(rows[limit - 1].created_at, rows[limit - 1].id) if len(rows) > limit else None
        return rows[:limit]

    def get_next_link(self) -> str | None:
        if self.next_cursor is None:
            return None
        return replace_query_param(self.request.build_absolute_uri(), "cursor", self.next_cursor)

    def get_paginated_response(self, data):
        return Response({"results": data, "next": self.get_next_link()})

    def get_paginated_response_schema(self, schema):
        return {
            "type": "object",
            "required": ["results", "next"],
            "properties": {
                "results": schema,
                "next": {"type": "string", "format": "uri", "nullable": True, "description": "the next page, or null"},
            },
        }

    def get_schema_operation_parameters(self, view):
        return []  # declared by the view's query serializer (PageQuery and its filters)
