"""The HTTP side both servers share: bounded body reads and error handlers that answer every
failure in OpenAI's error shape (the engine's server and the gateway alike)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from cachegw.protocol.errors import ApiError, error_body, error_code

log = logging.getLogger("cachegw.http")


class ClientGone(Exception):
    """The client of a non-streaming request disconnected; its request was aborted."""


async def read_limited_body(request: Request, limit: int) -> bytes:
    """The raw body, refused with 413 as soon as it is known to exceed ``limit`` bytes."""
    too_large = ApiError(
        413, f"The request body exceeds the limit of {limit} bytes.", code="request_too_large"
    )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def install_error_handlers(app: FastAPI, on_error: Callable[[int, str], None] | None = None) -> None:
    """Every error leaves as OpenAI's error JSON, never FastAPI's ``{"detail": ...}``.

    ``on_error(status, code)`` is told of each one (the gateway counts them for Prometheus)."""

    def answer(body: dict[str, Any], status: int, headers: Any = None) -> Response:
        if on_error is not None:
            on_error(status, error_code(body))
        return JSONResponse(body, status_code=status, headers=headers)

    async def api_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return answer(exc.body(), exc.status, exc.headers)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 404:
            message = f"Invalid URL ({request.method} {request.url.path})"
        else:
            message = str(exc.detail)
        return answer(error_body(message), exc.status_code, exc.headers)

    async def invalid_request(_: Request, exc: Exception) -> Response:
        """A bad query or path parameter: name it, as OpenAI names a bad body field."""
        assert isinstance(exc, RequestValidationError)
        errors = exc.errors()
        if not errors:
            return answer(error_body(str(exc)), 400)
        param = str(errors[0]["loc"][-1])
        message = f"Invalid value for '{param}': {errors[0]['msg']}."
        return answer(error_body(message, param=param), 400)

    async def client_gone(_: Request, __: Exception) -> Response:
        return Response(status_code=499)  # nobody reads it: the request was aborted

    async def internal(request: Request, exc: Exception) -> Response:
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        body = error_body(
            f"Internal server error: {type(exc).__name__}", "server_error", None, "internal_error"
        )
        return answer(body, 500)

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.add_exception_handler(ClientGone, client_gone)
    app.add_exception_handler(Exception, internal)
