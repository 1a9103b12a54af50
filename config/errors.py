"""Domain errors and the one DRF exception handler that maps them (H: error shape).

Every error body is ``{"error": "<code>", "detail": "<human text>"}`` plus optional extra
fields (for example ``task_id`` on ``folder_locked``).
"""
from django.core.exceptions import RequestDataTooBig
from django.http import JsonResponse
from rest_framework import exceptions, status
from rest_framework.parsers import JSONParser
from rest_framework.response import Response


class ApplicationError(Exception):
    """A refusal with an error code and an HTTP status; ``extra`` joins the body."""

    status_code = 400

    def __init__(self, code: str, detail: str = "", status_code: int | None = None, **extra):
        super().__init__(detail or code)
        self.code = code
        self.detail = detail or code.replace("_", " ")
        if status_code is not None:
            self.status_code = status_code
        self.extra = extra

    def body(self) -> dict:
        return {"error": self.code, "detail": self.detail, **self.extra}


class StrictJSONParser(JSONParser):
    """DRF's JSON parser, with nesting too deep for the decoder refused as malformed (K3)."""

    def parse(self, stream, media_type=None, parser_context=None):
        try:
            return super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise exceptions.ParseError("JSON nested too deeply")


def exception_handler(exc, context):
    """Map ApplicationError and DRF errors to the ``{"error", "detail"}`` shape (H, K3).

    Codes: an ApplicationError's own; ``invalid`` (400, with ``fields``: the per-field
    problems) for validation errors; ``malformed_json`` (400) for parse errors;
    ``body_too_large`` (413); ``not_found`` (404); otherwise DRF's code, e.g.
    ``not_authenticated`` (401), ``authentication_failed`` (401), ``permission_denied``
    (403), ``method_not_allowed`` (405), ``not_acceptable`` (406),
    ``unsupported_media_type`` (415), ``throttled`` (429, with ``Retry-After``)."""
    from rest_framework.views import exception_handler as drf_exception_handler  # avoids an import cycle

    if isinstance(exc, ApplicationError):
        return Response(exc.body(), status=exc.status_code)
    if isinstance(exc, RequestDataTooBig):
        return Response({"error": "body_too_large", "detail": str(exc)}, status=413)
    response = drf_exception_handler(exc, context)
    if response is None:
        return None
    if isinstance(exc, exceptions.ValidationError):
        response.data = {"error": "invalid", "detail": _first_problem(exc.detail), "fields": exc.detail}
        response.status_code = status.HTTP_400_BAD_REQUEST
        return response
    if response.status_code == 404:
        code = "not_found"
    elif isinstance(exc, exceptions.ParseError):
        code = "malformed_json"
    else:
        code = getattr(exc, "default_code", "error")
    detail = response.data.get("detail", "") if isinstance(response.data, dict) else ""
    response.data = {"error": code, "detail": str(detail)}
    return response


def _first_problem(detail, path: str = "") -> str:
    """A one-line summary of a validation error (``"machine: expected string, got
    integer"``) for clients that show only ``detail``."""
    if isinstance(detail, dict):
        for name, inner in detail.items():
            return _first_problem(inner, f"{path}.{name}" if path else str(name))
    if isinstance(detail, list) and detail:
        return _first_problem(detail[0], path)
    text = str(detail) if detail else "invalid input"
    return f"{path}: {text}" if path and path != "non_field_errors" else text


_API_HTML_ERRORS = {400: "bad_request", 404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}


def api_responses(get_response):
    """Middleware. Under ``/api/`` an error page that Django rendered as HTML (an unknown
    path, an id that is not a UUID) becomes ``{"error", "detail"}`` JSON (K3), whatever
    DEBUG is; and a HEAD answer carries headers only (daphne sends what it is given)."""

    def middleware(request):
        response = get_response(request)
        code = _API_HTML_ERRORS.get(response.status_code)
        if code and request.path.startswith("/api/") and response.get("Content-Type", "").startswith("text/html"):
            response = JsonResponse({"error": code, "detail": response.reason_phrase.lower()}, status=response.status_code)
        if request.method == "HEAD" and not response.streaming:
            length = len(response.content)
            response.content = b""
            response["Content-Length"] = str(length)
        return response

    return middleware
