"""Who is asking: the API key in `Authorization: Bearer` (or an `api-key` or Anthropic's `x-api-key`
header) names the tenant.

Open mode: any key is its own tenant. Keys mode: only configured keys, by name. Either way a key
is stored only as a hash, and the cache is keyed by that hash (or by "*" when the config shares
the cache between tenants).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass

from cachegw.gateway.config import TenantsConfig
from cachegw.protocol.errors import ApiError

ANONYMOUS = "anonymous"


@dataclass(frozen=True)
class Tenant:
    id: str  # hash of the key (what the request log stores)
    name: str  # configured name, else the hash
    cache_key: str  # what cache entries are keyed by


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:32]


class Tenants:
    def __init__(self, config: TenantsConfig) -> None:
        self.config = config
        self.by_hash = {key_hash(k): name for name, k in config.keys.items()}
        self._group_of = {m: g for g, members in config.prefix_groups.items() for m in members}

    def check_priority(self, tenant: Tenant, priority: object) -> None:
        """A 400 for a ``priority`` outside what the operator granted this tenant ([tenants])."""
        if priority is None:
            return
        lo, hi = self.config.priority_ranges.get(
            tenant.name, self.config.priority_ranges.get(tenant.id, self.config.priority_range)
        )
        if not isinstance(priority, int) or isinstance(priority, bool) or not lo <= priority <= hi:
            raise ApiError(
                400,
                f"priority must be an integer from {lo} to {hi} for this API key.",
                param="priority",
                code="priority_not_allowed",
            )

    def prefix_key(self, tenant: Tenant) -> str:
        """Who shares the backend's prefix cache: a ``prefix_groups`` group the operator declared
        (named by tenant name or key hash), else whoever shares the tenant's cached answers."""
        group = self._group_of.get(tenant.name, self._group_of.get(tenant.id))
        return f"group\0{group}" if group is not None else tenant.cache_key

    def resolve(self, authorization: str | None, api_key: str | None = None) -> Tenant:
        """From ``Authorization: Bearer KEY``, else Azure's ``api-key: KEY`` (or Anthropic's
        ``x-api-key``) header, else another scheme's whole credential ("Basic ..."), so that no client
        that sends a key shares the anonymous tenant."""
        key = ""
        if authorization and authorization.strip():
            scheme, _, value = authorization.strip().partition(" ")
            key = value.strip() if scheme.lower() == "bearer" else authorization.strip()
        if not key and api_key:
            key = api_key.strip()
        if self.config.mode == "keys":
            h = key_hash(key) if key else ""
            if h not in self.by_hash:
                raise ApiError(
                    401,
                    "Incorrect API key provided." if key else "You didn't provide an API key.",
                    code="invalid_api_key",
                )
            name = self.by_hash[h]
        else:
            h = key_hash(key) if key else ANONYMOUS
            name = h
        return Tenant(h, name, "*" if self.config.shared_cache else h)

    def from_headers(self, headers: Mapping[str, str]) -> Tenant:
        return self.resolve(headers.get("authorization"), headers.get("api-key") or headers.get("x-api-key"))

    def id_of(self, name_or_id: str) -> str:
        """A tenant named in the admin API: a configured name, else taken as the key hash itself."""
        key = self.config.keys.get(name_or_id)
        return key_hash(key) if key is not None else name_or_id

    def name_of(self, tenant_id: str) -> str:
        return self.by_hash.get(tenant_id, tenant_id)

    def cache_key_of(self, name_or_id: str) -> str:
        return "*" if self.config.shared_cache else self.id_of(name_or_id)


class PrefixSalts:
    """Per-tenant ``cache_salt``: tenants never share the backend's prefix cache unless they share answers.

    Without it, a tenant could test a guess of another tenant's system prompt by the ``cached_tokens``
    (or the latency) of its own request. The salt is an HMAC keyed by a secret derived from the admin
    token, so it cannot be computed from a tenant's name; every replica with the same admin token
    derives the same salts, so routing to one backend keeps its prefix cache warm across replicas.
    A client's own ``cache_salt`` is combined with the tenant's, never used in its place.
    """

    def __init__(self, admin_token: str) -> None:
        self._secret = hashlib.sha256(b"cachegw-prefix-salt\0" + admin_token.encode()).digest()

    def salt(self, tenant_cache_key: str, client_salt: object = None) -> str:
        """The salt sent upstream for this tenant (tenants with ``shared_cache`` share one key)."""
        own = client_salt if isinstance(client_salt, str) else ""
        msg = tenant_cache_key.encode() + b"\0" + own.encode()
        return hmac.new(self._secret, msg, hashlib.sha256).hexdigest()[:32]
