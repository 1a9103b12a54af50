from rest_framework.pagination import CursorPagination


class NewestFirst(CursorPagination):
    """Lists are paginated newest first: ``{"results": [...], "next": ..., "previous": ...}`` (K3)."""

    ordering = "-created_at"
    page_size = 50
