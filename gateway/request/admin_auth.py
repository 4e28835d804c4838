"""The admin token: from config, else CACHEGW_ADMIN_TOKEN, else generated once into the data dir.

Tenants' API keys never open the admin API: only this token does, compared in constant time.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
from pathlib import Path

from cachegw.protocol.errors import ApiError

log = logging.getLogger("cachegw.gateway")
TOKEN_FILE = "admin_token"
ENV = "CACHEGW_ADMIN_TOKEN"


def resolve_admin_token(configured: str, data_dir: Path) -> str:
    """The token in force; a generated one is written owner-only and printed once, when made."""
    if configured:
        return configured
    if os.environ.get(ENV):
        return os.environ[ENV]
    path = data_dir / TOKEN_FILE
    if path.exists():
        return path.read_text().strip()
    token = f"cgw-admin-{secrets.token_urlsafe(24)}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    print(f"cachegw: generated the admin token (kept in {path}, owner-only): {token}", flush=True)
    return token


class AdminAuth:
    """A bearer token check; ``what`` names the token in errors (the metrics token uses it too)."""

    def __init__(self, token: str, what: str = "admin") -> None:
        self._token = token.encode()
        self._what, self._code = what, f"{what}_unauthorized"

    def check(self, authorization: str | None) -> None:
        """401 unless ``Authorization: Bearer <token>``; the body never says what was expected."""
        scheme, _, value = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not value.strip():
            raise ApiError(
                401,
                f"{self._what.capitalize()} token required (Authorization: Bearer <token>).",
                code=self._code,
            )
        if not hmac.compare_digest(value.strip().encode(), self._token):
            raise ApiError(401, f"Invalid {self._what} token.", code=self._code)
