"""Errors as OpenAI-style bodies `{"error": {"message", "type", "param", "code"}}`: `ApiError`, the app's exception
handlers, and pydantic validation errors turned into a 400 naming the field."""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from refusion.serve.schemas import UnsupportedValue, error_body

log = logging.getLogger("refusion.serve")

ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
               500: "server_error", 503: "server_error", 504: "server_error"}


class ApiError(Exception):
    """An error answered with an OpenAI-style body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def response(self) -> JSONResponse:
        body = error_body(self.message, type=ERROR_TYPES.get(self.status, "invalid_request_error"),
                          param=self.param, code=self.code)
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def request_validation_error(request: Request, e: RequestValidationError):
        return validation_error(e).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        return ApiError(e.status_code, str(e.detail), headers=getattr(e, "headers", None)).response()

    @app.exception_handler(Exception)
    async def server_error(request: Request, e: Exception):
        log.exception("unhandled error")
        return ApiError(500, f"internal error: {type(e).__name__}: {e}").response()


def validation_error(e: RequestValidationError | ValidationError) -> ApiError:
    """The first pydantic error as a 400 naming the field (`refusion.slot_size`, `messages.0.role`, ...)."""
    errors = e.errors()
    if not errors:
        return ApiError(400, "invalid request body")
    err = errors[0]
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, UnsupportedValue):
        return ApiError(400, str(cause), param=cause.param)
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    loc = [x for x in loc if not _is_union_branch(x)]
    param = ".".join(loc) or None
    if err.get("type") == "missing":
        return ApiError(400, f"missing required field {param!r}", param=param)
    if err.get("type") == "extra_forbidden":
        return ApiError(400, f"unknown field {param!r}", param=param)
    try:
        got = json.dumps(err.get("input"), default=str)
    except (RecursionError, ValueError):  # nested too deeply to show (or circular)
        got = type(err.get("input")).__name__
    got = got if len(got) <= 80 else got[:77] + "..."
    where = f"{param}: " if param else "request body: "
    return ApiError(400, f"{where}{err.get('msg', 'invalid value')} (got {got})", param=param)


def _is_union_branch(part: str) -> bool:
    """pydantic names the branch of a union in the error location (`str`, `list[int]`, ...)."""
    return part in ("str", "int", "float", "bool", "function-after") or part.startswith(("list[", "dict["))
