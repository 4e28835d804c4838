"""Per-tenant ``cache_salt``: tenants never share the backend's prefix cache unless they share answers.

Without it, a tenant could test a guess of another tenant's system prompt by the ``cached_tokens``
(or the latency) of its own request. The salt is an HMAC keyed by a secret derived from the admin
token, so it cannot be computed from a tenant's name; every replica with the same admin token
derives the same salts, so routing to one backend keeps its prefix cache warm across replicas.
A client's own ``cache_salt`` is combined with the tenant's, never used in its place.
"""

from __future__ import annotations

import hashlib
import hmac


class PrefixSalts:
    def __init__(self, admin_token: str) -> None:
        self._secret = hashlib.sha256(b"cachegw-prefix-salt\0" + admin_token.encode()).digest()

    def salt(self, tenant_cache_key: str, client_salt: object = None) -> str:
        """The salt sent upstream for this tenant (tenants with ``shared_cache`` share one key)."""
        own = client_salt if isinstance(client_salt, str) else ""
        msg = tenant_cache_key.encode() + b"\0" + own.encode()
        return hmac.new(self._secret, msg, hashlib.sha256).hexdigest()[:32]
