"""OpenAI's error shape, and the exception that carries it to the client."""

from __future__ import annotations

from typing import Any


def error_body(
    message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_code(body: Any) -> str:
    """The code of an error body, else its type ("" when it is not OpenAI's error shape)."""
    err = body.get("error") if isinstance(body, dict) else None
    return str(err.get("code") or err.get("type") or "") if isinstance(err, dict) else ""


class ApiError(Exception):
    """An error answered to the client as ``error_body`` with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers  # sent with the error (e.g. Retry-After on a 503)

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)
