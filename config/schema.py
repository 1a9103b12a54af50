"""OpenAPI helpers shared by both apps (H): the one error shape and the error responses
every operation declares, so a client generated from ``/api/schema/`` can read refusals."""
from drf_spectacular.utils import OpenApiResponse, extend_schema, extend_schema_view
from drf_spectacular.views import SpectacularAPIView
from rest_framework import serializers
from rest_framework.renderers import JSONRenderer


class ErrorOut(serializers.Serializer):
    """Every 4xx body: ``{"error": "<code>", "detail": "<human text>"}``; some codes add
    fields (``fields`` on ``invalid``, ``task_id`` on ``folder_locked``, ``reason`` on a
    refused lease)."""

    error = serializers.CharField(help_text="a stable machine-readable code, e.g. invalid, not_found")
    detail = serializers.CharField(help_text="human-readable text")
    fields = serializers.DictField(required=False, help_text="on invalid: the problems per field")
    task_id = serializers.UUIDField(required=False, help_text="on folder_locked: the task that holds the lock")
    reason = serializers.CharField(required=False, help_text="on a refused lease or renewal: the L5 reason")
    retry_after_s = serializers.IntegerField(required=False, help_text="on 429: seconds to wait, as in Retry-After")


_ERROR_TEXT = {
    400: "bad input (invalid, malformed_json, invalid_cursor, ...)",
    401: "not authenticated, or a revoked token (token_revoked)",
    403: "authenticated but not allowed (permission_denied, machine_forbidden, ...)",
    404: "not found, or not the caller's (not_found)",
    405: "method not allowed",
    409: "conflict with the current state",
    413: "body too large",
    415: "not JSON",
    422: "idempotency key reused with another body",
    429: "too many requests (rate_limited, too_many_attempts); Retry-After says when to retry, in seconds",
}

# 413: any request body over DATA_UPLOAD_MAX_MEMORY_SIZE, refused before parsing (K3;
# found undocumented on POST /api/worker/progress/ by the schemathesis run).
COMMON_ERRORS = (400, 401, 403, 404, 405, 413, 415)


def errors(*extra: int) -> dict:
    """``responses`` entries for the common refusals plus ``extra`` statuses, all with
    ``ErrorOut``. Use as ``responses={200: Out, **errors(409)}``."""
    return {code: OpenApiResponse(ErrorOut, description=_ERROR_TEXT.get(code, "refused")) for code in (*COMMON_ERRORS, *extra)}


@extend_schema_view(get=extend_schema(exclude=True))
class SchemaView(SpectacularAPIView):
    """``GET /api/schema/``: the OpenAPI document, which leaves itself out. Public, and
    no credential is read: a stale token gets the document, not a 401 (K2 matrix)."""

    authentication_classes = []

    def handle_exception(self, exc):
        """Refusals under ``/api/`` are JSON ``{"error", "detail"}`` (H), not a YAML body in
        the document's media type."""
        response = super().handle_exception(exc)
        self.request.accepted_renderer, self.request.accepted_media_type = JSONRenderer(), "application/json"
        return response
