"""Domain errors and the one DRF exception handler that maps them (H: error shape).

Every error body is ``{"error": "<code>", "detail": "<human text>"}`` plus optional extra
fields (for example ``task_id`` on ``folder_locked``).
"""
from rest_framework import exceptions, status
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




def exception_handler(exc, context):
    """Map ApplicationError and DRF errors to the ``{"error", "detail"}`` shape."""
    from rest_framework.views import exception_handler as drf_exception_handler  # avoids an import cycle

    if isinstance(exc, ApplicationError):
        return Response(exc.body(), status=exc.status_code)
    response = drf_exception_handler(exc, context)
    if response is None:
        return None
    if isinstance(exc, exceptions.ValidationError):
        response.data = {"error": "invalid", "detail": "invalid input", "fields": exc.detail}
        response.status_code = status.HTTP_400_BAD_REQUEST
        return response
    if response.status_code == 404:
        code = "not_found"
    elif isinstance(exc, exceptions.ParseError):
        code = "malformed_json"
    else:
        code = getattr(exc, "code", None) or getattr(exc, "default_code", "error")
    detail = response.data.get("detail", "") if isinstance(response.data, dict) else ""
    response.data = {"error": code, "detail": str(detail)}
    return response
