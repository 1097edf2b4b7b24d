"""OpenAI-style error bodies and the exception -> status mapping of the server.

Every error the server answers has the body the official clients parse:
    {"error": {"message": "...", "type": "...", "param": "..." | null, "code": "..." | null}}
"""

from __future__ import annotations

import logging
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from outpace.engine.async_engine import EngineDeadError
from outpace.errors import (InvalidRequestError, ModelNotFoundError, OutpaceError,
                            QueueFullError)

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1  # what a 503 for a full queue tells the client to wait

_TYPE_OF_STATUS = {
    400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
    405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
    422: "invalid_request_error", 500: "internal_server_error", 503: "service_unavailable",
}


class APIError(Exception):
    """An error answer; raised anywhere in a handler, turned into a response by the handler."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def error_body(status: int, message: str, param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": _TYPE_OF_STATUS.get(status, "api_error"),
                      "param": param, "code": code}}


def to_api_error(exc: BaseException) -> APIError:
    """Map an exception from request handling to the answer the client gets."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ModelNotFoundError):
        return APIError(404, str(exc), param="model", code="model_not_found")
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc))
    if isinstance(exc, QueueFullError):
        return APIError(503, f"the waiting queue is full ({exc}); retry after "
                        f"{RETRY_AFTER_S} s", code="queue_full",
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, ClientDisconnect):
        return APIError(499, "the client closed the connection while sending the request")
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), code="engine_dead")
    if isinstance(exc, RecursionError):
        return APIError(400, "the request nests too deeply to process")
    log.error("internal error while serving a request", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}")


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(error_body(err.status, err.message, err.param, err.code),
                        status_code=err.status, headers=err.headers)


def install_error_handlers(app: FastAPI, on_error=None) -> None:
    """Unknown routes, wrong methods and anything that escapes a handler get OpenAI bodies too.

    `on_error(status)` is called for every error answered (metrics)."""

    def respond(err: APIError) -> JSONResponse:
        if on_error is not None:
            on_error(err.status)
        return error_response(err)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return respond(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        msg = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            msg = f"no route {request.url.path!r}; see /v1/models, /v1/completions, " \
                  "/v1/chat/completions, /tokenize, /detokenize, /health, /metrics, /version"
        elif exc.status_code == 405:
            msg = f"method {request.method} is not allowed on {request.url.path!r}"
        return respond(APIError(exc.status_code, msg, headers=getattr(exc, "headers", None)))

    # Typed errors get their own handler: Starlette routes a bare `Exception` handler through
    # its outermost middleware, which re-raises after answering and drops the connection.
    @app.exception_handler(OutpaceError)
    async def _outpace_error(_: Request, exc: OutpaceError):
        return respond(to_api_error(exc))

    @app.exception_handler(Exception)
    async def _any_error(_: Request, exc: Exception):
        return respond(to_api_error(exc))
