"""The decode side of disaggregation: a ``role = "decode"`` engine has its long prompts computed by its
prefill engine (``[engine] prefill_url``) before they join its batch.

Before a request is added, the prompt's reusable blocks (``core/kv_handover.py``) are looked up in this
engine's pool. When at least ``prefill_min_tokens`` of the prompt are missing, the token ids go to the
prefill engine's ``POST /v1/prefill``, which answers once the blocks are in the shared tier; they are
then read into this engine's RAM tier (off the engine thread), so the request's admission copies them
from memory and its running streams never wait on a long prefill or on the store. Shorter prompts,
and prompts the pool already holds, are computed here: the hop would cost more than it saves.

A prefill engine that is down, slow past ``prefill_timeout_s`` or answering an error costs nothing
but time: the prompt is then computed here, as a ``role = "both"`` engine would (logged, and counted
in ``cachegw:prefill_handovers_total{outcome="fallback"}``). The request itself never fails for it.
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
from prometheus_client import CollectorRegistry, Counter

from cachegw.backend.core.async_engine import AsyncEngine
from cachegw.backend.core.kv_handover import pooled_run, reusable_hashes
from cachegw.backend.core.sampling_params import SamplingParams
from cachegw.backend.entrypoints.prefill_route import PREFILL_PATH

log = logging.getLogger("cachegw.backend")

_DOC = (
    "Prompts of a decode engine by who computed them: remote (its prefill engine), local (short or "
    "already held), fallback (the prefill engine failed)."
)
RETRY_AFTER_FAILURE_S = 5.0  # a failed prefill engine is not asked again for this long


class PrefillPeer:
    """The decode engine's link to its prefill engine (one per server)."""

    def __init__(self, engine: AsyncEngine, registry: CollectorRegistry) -> None:
        cfg = engine.engine.config
        self.engine = engine
        self.url = cfg.prefill_url.rstrip("/")
        self.min_tokens = cfg.prefill_min_tokens
        self.block_size = cfg.block_size
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(cfg.prefill_timeout_s, connect=2.0))
        self.handovers = Counter("cachegw:prefill_handovers", _DOC, ["outcome"], registry=registry)
        self._down_until = 0.0

    async def prepare(self, ids: list[int], params: SamplingParams, salt: str | None) -> str:
        """Have the prompt's missing blocks computed by the prefill engine and read into RAM; returns
        the outcome counted (remote, local, fallback)."""
        engine = self.engine.engine
        adapter = params.lora.digest if params.lora is not None else None
        hashes = reusable_hashes(ids, self.block_size, salt, adapter)
        held = pooled_run(engine.block_manager, hashes)
        if len(ids) - held * self.block_size < self.min_tokens or params.echo:
            return self._count("local")
        if time.monotonic() < self._down_until:
            return self._count("fallback")
        body = {"prompt": ids, "cache_salt": salt, "model": params.lora.name if params.lora else None}
        start = time.perf_counter()
        try:
            r = await self.client.post(f"{self.url}{PREFILL_PATH}", json=body)
            r.raise_for_status()
            handed = int(r.json()["handed_over_tokens"]) // self.block_size
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            self._down_until = time.monotonic() + RETRY_AFTER_FAILURE_S
            log.warning("prefill engine %s failed (%s); computing the prompt here", self.url, _reason(exc))
            return self._count("fallback")
        computed = time.perf_counter()
        tier = engine.kv_tier
        if tier is not None and handed:
            pool = engine.block_manager.cached  # one lookup at a time: the engine thread changes it
            tier.prefetch([h for h in hashes[:handed] if h not in pool])
            await asyncio.to_thread(tier.flush)  # the worker reads them in order: done when it is idle
        log.debug(
            "prompt of %d tokens: %d handed over by the prefill engine in %.2f s, read in %.2f s",
            len(ids), handed * self.block_size, computed - start, time.perf_counter() - computed,
        )  # fmt: skip
        return self._count("remote")

    def _count(self, outcome: str) -> str:
        self.handovers.labels(outcome).inc()
        return outcome

    async def close(self) -> None:
        await self.client.aclose()


def _reason(exc: Exception) -> str:
    if isinstance(exc, httpx.HTTPStatusError):
        return f"HTTP {exc.response.status_code}: {exc.response.text[:200]}"
    return f"{type(exc).__name__}: {exc}"
