"""Every error the server returns, in OpenAI's shape:
``{"error": {"message", "type", "param", "code"}}`` with the matching HTTP status."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

log = logging.getLogger("tandem.serve")

# What vLLM and nginx count a request as when its client leaves before the answer.
CLIENT_CLOSED_REQUEST = 499

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class ClientDisconnected(Exception):
    """The client left before its answer was ready (its requests are aborted)."""


def error_body(status: int, message: str, param=None, code=None) -> dict:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def from_validation(exc: ValidationError | RequestValidationError) -> APIError:
    """The first problem of a request body, naming the field."""
    errors = exc.errors() or [{"loc": (), "msg": "invalid request", "type": ""}]
    # A union field fails once per member type: report the most specific failure (deepest,
    # and a broken constraint rather than a type mismatch) of the first field that failed.
    field = _param(errors[0]["loc"][:1])
    candidates = [e for e in errors if _param(e["loc"][:1]) == field]
    first = max(
        candidates, key=lambda e: (len(_param(e["loc"]) or ""), not e["type"].endswith("_type"))
    )
    param = _param(first["loc"])
    if first["type"] in ("json_invalid", "json_type"):
        return APIError(400, f"request body is not valid JSON: {first['msg']}", code="bad_json")
    if first["type"] == "extra_forbidden":
        message = f"unknown field `{param}`"
    elif first["type"] == "missing":
        message = f"`{param}` is required"
    elif param:
        message = f"`{param}`: {first['msg'].removeprefix('Value error, ')}"
    else:
        message = first["msg"].removeprefix("Value error, ")
    others = {_param(e["loc"][:1]) for e in errors} - {field}
    more = f" (also: {', '.join(sorted(map(str, others)))})" if others else ""
    return APIError(400, message + more, param=param, code="invalid_value")


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _param(loc) -> str | None:
    """The field path of an error location, without pydantic's union-member tags."""
    keep = [
        str(p)
        for p in loc
        if isinstance(p, int) or (p.isidentifier() and p not in _TYPE_TAGS and p != "body")
    ]
    return ".".join(keep) or None


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return from_validation(exc).response()

    async def _left(request: Request, exc: Exception):
        log.info(
            "%s %s: the client disconnected before the answer (%d); nothing left running",
            request.method,
            request.url.path,
            CLIENT_CLOSED_REQUEST,
        )
        return Response(status_code=CLIENT_CLOSED_REQUEST)  # counted in the metrics only

    # while generating (its requests are aborted), or while its body was still arriving
    app.add_exception_handler(ClientDisconnected, _left)
    app.add_exception_handler(ClientDisconnect, _left)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        return APIError(exc.status_code, str(exc.detail), headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}").response()
