"""Errors that reach the HTTP client, always in OpenAI's shape.

Anything that can answer a client raises ``ApiError`` (or hands one to the
request's event stream); the handlers installed by ``install_error_handlers``
turn it, FastAPI's own validation errors and unexpected exceptions into

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

with the matching status and, for 429 and 503, a ``Retry-After`` header.
"""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("tessera.proxy")

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class ApiError(Exception):
    """An error with everything the client needs: status, message, and what to change."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.retry_after_s = retry_after_s

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def invalid_value(message: str, param: str | None = None) -> ApiError:
    """A body that does not parse or a field out of its bounds: 400 naming the field, as OpenAI answers."""
    return ApiError(400, message, code="invalid_value", param=param)


def from_validation_error(exc: ValidationError | RequestValidationError) -> ApiError:
    """The first field error, named by its path (``messages.0.content``)."""
    errors = exc.errors()
    if not errors:
        return invalid_value("invalid request")
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    where = f"{param}: " if param else ""
    more = f" (and {len(errors) - 1} more error(s))" if len(errors) > 1 else ""
    return invalid_value(f"{where}{first.get('msg', 'invalid value')}{more}", param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return ApiError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error serving %s %s", request.method, request.url.path)
        return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error").response()
