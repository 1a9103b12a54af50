"""The one DRF exception handler (settings ``EXCEPTION_HANDLER``): every error answer of
the API is ``{"error": "<code>", "detail": "<human text>"}`` plus optional fields (H, K3).

Kept apart from ``core/errors.py`` because it needs ``rest_framework.views``, which
imports the authentication classes that import ``core.errors``.
"""
import math

from django.core.exceptions import RequestDataTooBig
from django.db import OperationalError
from psycopg_pool import PoolTimeout
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from core.errors import ApplicationError, ErrorShape, service_busy


def exception_handler(exc, context):
    """Map ApplicationError and DRF errors to the ``{"error", "detail"}`` shape (H, K3).

    Codes: an ApplicationError's own; ``invalid`` (400, with ``fields``: the per-field
    problems) for validation errors; ``malformed_json`` (400) for parse errors;
    ``body_too_large`` (413); ``not_found`` (404); otherwise DRF's code, e.g.
    ``not_authenticated`` (401), ``authentication_failed`` (401), ``permission_denied``
    (403), ``method_not_allowed`` (405), ``not_acceptable`` (406),
    ``unsupported_media_type`` (415); ``rate_limited`` (429, with ``retry_after_s`` and a
    ``Retry-After`` header, whole seconds) for a throttle (core/throttling.py);
    ``service_busy`` (503, ``Retry-After: 1``) when the database connection pool had no
    connection to give within its timeout (``psycopg_pool.PoolTimeout``): the process is
    overloaded, not broken, and the request changed nothing (D; a worker tries again)."""
    if isinstance(exc, OperationalError) and isinstance(exc.__cause__, PoolTimeout):
        exc = service_busy()
    if isinstance(exc, ApplicationError):
        return Response(exc.body(), status=exc.status_code, headers=exc.headers)
    if isinstance(exc, exceptions.Throttled):
        wait = max(1, math.ceil(exc.wait or 1))
        return Response(ErrorShape(error="rate_limited", detail=f"too many requests, retry in {wait} s", retry_after_s=wait),
                        status=429, headers={"Retry-After": str(wait)})
    if isinstance(exc, RequestDataTooBig):
        return Response(ErrorShape(error="body_too_large", detail=str(exc)), status=413)
    response = drf_exception_handler(exc, context)
    if response is None:
        return None
    if isinstance(exc, exceptions.ValidationError):
        response.data = ErrorShape(error="invalid", detail=_first_problem(exc.detail), fields=exc.detail)
        response.status_code = status.HTTP_400_BAD_REQUEST
        return response
    if response.status_code == 404:
        code = "not_found"
    elif isinstance(exc, exceptions.ParseError):
        code = "malformed_json"
    else:
        code = getattr(exc, "default_code", "error")
    detail = response.data.get("detail", "") if isinstance(response.data, dict) else ""
    response.data = ErrorShape(error=code, detail=str(detail))
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
