"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`, for every failure.

Status policy: the client's fault is a 4xx (400 for anything about the body, including what
pydantic rejects, where FastAPI would say 422), the server's state is a 503 (queue full, engine
down, shutting down), and only a bug is a 500.
"""
from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from sparsex.entrypoints.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

# OpenAI's `type` values for each status we send.
_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 503: "server_error", 500: "server_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    info = ErrorInfo(message=message, type=_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error"),
                     param=param, code=code)
    return ErrorResponse(error=info).model_dump()


# pydantic names the branch of a union in `loc` ("str", "list[TextPart]"): not part of a field path
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _field_path(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    parts = [p for p in parts if p.lower() not in _TYPE_TAGS and "[" not in p]
    return ".".join(parts) or None


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = list(exc.errors())
    if not errors:
        return "invalid request", None
    if any(e.get("type") == "json_invalid" for e in errors):
        return "the request body is not valid JSON", None
    # the deepest location is the most specific complaint (a union reports one error per branch)
    first = max(errors, key=lambda e: len(e.get("loc", ())))
    param = _field_path(tuple(first.get("loc", ())))
    msg = first.get("msg", "invalid value")
    return (f"{param}: {msg}" if param else msg), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return JSONResponse(error_body(400, message, param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}"), status_code=500)
