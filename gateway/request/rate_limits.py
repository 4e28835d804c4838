"""Per-tenant rate limits: requests and backend tokens a minute ([tenants] rate_limits), counted across
replicas in the database (one row per tenant and minute, ``gateway/storage/rate_store.py``).

Fixed one-minute windows: simple, the same on every replica, and at most twice the budget across a
window's edge. Every request counts against ``requests_per_minute`` (hits too: a tenant flooding the
gateway costs it work); only the tokens a backend spent count against ``tokens_per_minute``, so cached
answers never use a tenant's token budget. Beyond a limit: 429 ``rate_limit_exceeded`` with
``Retry-After`` (the seconds to the next window), in OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

from cachegw.gateway.config import RateLimit, TenantsConfig
from cachegw.gateway.request.tenants import Tenant
from cachegw.gateway.storage.rate_store import RateStore
from cachegw.protocol.errors import ApiError

WINDOW_S = 60


class RateLimiter:
    def __init__(
        self, config: TenantsConfig, store: RateStore, clock: Callable[[], float] = time.time
    ) -> None:
        self.limits, self.store, self.clock = config.rate_limits, store, clock
        self.configured = any(v.requests_per_minute or v.tokens_per_minute for v in self.limits.values())

    def limit_of(self, tenant: Tenant) -> RateLimit | None:
        """The tenant's own limit (by name, then key hash), else the "*" one; None when unlimited."""
        limit = self.limits.get(tenant.name) or self.limits.get(tenant.id) or self.limits.get("*")
        if limit is None or not (limit.requests_per_minute or limit.tokens_per_minute):
            return None
        return limit

    async def admit(self, tenant: Tenant) -> None:
        """Count this request; a 429 when the tenant is over either budget of this minute."""
        limit = self.limit_of(tenant)
        if limit is None:
            return
        now = self.clock()
        requests, tokens = await asyncio.to_thread(self.store.add, tenant.id, int(now // WINDOW_S), 1, 0)
        retry = str(max(1, math.ceil(WINDOW_S - now % WINDOW_S)))
        if limit.requests_per_minute and requests > limit.requests_per_minute:
            raise self._exceeded("requests", limit.requests_per_minute, retry)
        if limit.tokens_per_minute and tokens >= limit.tokens_per_minute:
            raise self._exceeded("tokens", limit.tokens_per_minute, retry)

    async def spend(self, tenant: Tenant, tokens: int) -> None:
        """Add what a backend spent on the tenant's request to its token budget."""
        limit = self.limit_of(tenant)
        if limit is None or not limit.tokens_per_minute or tokens <= 0:
            return
        await asyncio.to_thread(self.store.add, tenant.id, int(self.clock() // WINDOW_S), 0, tokens)

    def prune(self) -> None:
        """Drop windows older than the previous minute (they can no longer refuse anything)."""
        self.store.prune(int(self.clock() // WINDOW_S) - 1)

    @staticmethod
    def _exceeded(kind: str, budget: int, retry: str) -> ApiError:
        return ApiError(
            429,
            f"Rate limit reached: {budget} {kind} per minute for this API key. Retry after {retry} s.",
            type=kind,
            code="rate_limit_exceeded",
            headers={"Retry-After": retry},
        )
