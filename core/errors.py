"""Domain errors, the strict JSON parser and the HTML-to-JSON error middleware (H: error
shape); the DRF exception handler that maps errors is ``core/exception_handler.py``.

This module imports no DRF view code: DRF imports it (through the authentication and
parser classes named in settings) while ``rest_framework.views`` is being loaded.

Every error body is ``{"error": "<code>", "detail": "<human text>"}`` plus optional extra
fields (for example ``task_id`` on ``folder_locked``): ``ErrorShape``, from which the
schema's error component is generated (``core.schema.errors``).
"""
from typing import Annotated, Any, NotRequired, TypedDict

from django.http import JsonResponse
from rest_framework import exceptions
from rest_framework.parsers import JSONParser

from core.wire import Doc, Uuid


class ErrorShape(TypedDict):
    """Every 4xx body: ``{"error": "<code>", "detail": "<human text>"}``; some codes add
    fields (``fields`` on ``invalid``, ``task_id`` on ``folder_locked``, ``retry_after_s``
    on a 429)."""

    error: Annotated[str, Doc("a stable machine-readable code, e.g. invalid, not_found")]
    detail: Annotated[str, Doc("human-readable text")]
    fields: NotRequired[Annotated[dict[str, Any], Doc("on invalid: the problems per field")]]
    task_id: NotRequired[Annotated[Uuid, Doc("on folder_locked: the task that holds the lock")]]
    retry_after_s: NotRequired[Annotated[int, Doc("on 429: seconds to wait, as in Retry-After")]]
    machines: NotRequired[Annotated[list[dict[str, Any]], Doc(
        "on no_machine_available (C8): per machine of yours, why it cannot take the task: "
        "{id, name, reason, ...}")]]


class ApplicationError(Exception):
    """A refusal with an error code and an HTTP status; ``extra`` joins the body and
    ``headers`` the response."""

    status_code = 400

    headers: dict | None = None  # response headers, e.g. Retry-After on a 429

    def __init__(self, code: str, detail: str = "", status_code: int | None = None, headers: dict | None = None, **extra):
        super().__init__(detail or code)
        self.code = code
        self.headers = headers
        self.detail = detail or code.replace("_", " ")
        if status_code is not None:
            self.status_code = status_code
        self.extra = extra

    def body(self) -> ErrorShape:
        return {"error": self.code, "detail": self.detail, **self.extra}


def service_busy() -> ApplicationError:
    """503 ``service_busy`` with ``Retry-After: 1`` (D2): the process is overloaded, not
    broken, and the request changed nothing (no pooled connection in time,
    ``core.exception_handler``; no slot in time, ``core.admission``)."""
    return ApplicationError("service_busy", "the service is busy, try again in 1 s", status_code=503,
                            headers={"Retry-After": "1"}, retry_after_s=1)


class StrictJSONParser(JSONParser):
    """DRF's JSON parser, with nesting too deep for the decoder refused as malformed (K3)."""

    def parse(self, stream, media_type=None, parser_context=None):
        try:
            return super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise exceptions.ParseError("JSON nested too deeply")


_API_HTML_ERRORS = {400: "bad_request", 404: "not_found", 405: "method_not_allowed", 413: "body_too_large",
                    500: "server_error"}


def api_responses(get_response):
    """Middleware. Under ``/api/`` an error page that Django rendered as HTML (an unknown
    path, an id that is not a UUID, a 500 from an exception) becomes ``{"error", "detail"}``
    JSON (K3), whatever DEBUG is (a 500's stack trace goes to the log, never to a client); and a HEAD answer carries headers only (daphne sends what it is given)."""

    def middleware(request):
        response = get_response(request)
        code = _API_HTML_ERRORS.get(response.status_code)
        if code and request.path.startswith("/api/") and response.get("Content-Type", "").startswith("text/html"):
            response = JsonResponse(ErrorShape(error=code, detail=response.reason_phrase.lower()), status=response.status_code)
        if request.method == "HEAD" and not response.streaming:
            length = len(response.content)
            response.content = b""
            response["Content-Length"] = str(length)
        return response

    return middleware
