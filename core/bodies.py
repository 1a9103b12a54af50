"""Larger request bodies for the few routes that need them (K3, G7).

``DATA_UPLOAD_MAX_MEMORY_SIZE`` (256 KiB) bounds every body. A route named in
``settings.RUNSTEAD_BODY_LIMITS`` (``{path: bytes}``) is read here instead, up to its own
limit, before anything else touches the body: a final receipt carries a worktree task's
diff (256 KiB of text, more once JSON-escaped). Over the limit it answers 413
``body_too_large`` with the error shape, unread.
"""
from io import BytesIO

from django.conf import settings
from django.http import JsonResponse

BODY_METHODS = ("POST", "PUT", "PATCH")


def _too_large(limit: int) -> JsonResponse:
    return JsonResponse({"error": "body_too_large", "detail": f"request body exceeds {limit} bytes"}, status=413)


def body_limits(get_response):
    """Middleware: the body of a route in ``RUNSTEAD_BODY_LIMITS`` is read up to its limit
    (and kept, so Django and DRF parse it from memory), else 413."""

    def middleware(request):
        limit = settings.RUNSTEAD_BODY_LIMITS.get(request.path_info)
        if limit is not None and request.method in BODY_METHODS:
            try:
                declared = int(request.META.get("CONTENT_LENGTH") or 0)
            except ValueError:
                declared = 0
            if declared > limit:
                return _too_large(limit)
            body = request.read(limit + 1)
            if len(body) > limit:
                return _too_large(limit)
            request._body = body
            request._stream = BytesIO(body)
        return get_response(request)

    return middleware
