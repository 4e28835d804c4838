"""Active health of the backends: each is probed every few seconds, and one that stops answering is
marked down.

A refused connection shows at once, but a backend that hangs (stopped, deadlocked, a dead GPU
behind a live socket) accepts connections and never answers: without probes every miss would wait
the whole read timeout. A probe is ``GET /health`` beside the backend's ``/v1`` (the built-in engine,
vLLM, SGLang and llama.cpp all answer it), or ``GET /v1/models`` where ``/health`` is not found (a
hosted API); both carry the backend's own credentials. ``misses`` probes in a row without an
answer in time (or with a 5xx) mark it down in ``Backends.down``: routing skips it and a miss with
no backend up gets a 503 at once. One answered probe marks it up again, and its models are re-read.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import httpx

from cachegw.gateway.upstream.proxy import Backends

log = logging.getLogger("cachegw.gateway")
_NOT_THERE = (401, 403, 404, 405)  # no such route here, or it wants what only /v1/models is sent


@dataclass
class ProbeState:
    """One backend as the probes see it."""

    misses: int = 0  # in a row
    use_models: bool = False  # /health is not there: probe /v1/models
    last_error: str = ""


def health_url(url: str) -> str:
    """``http://host:8000/v1`` -> ``http://host:8000/health``: servers answer it at their root."""
    return f"{url.removesuffix('/v1')}/health"


class HealthProbes:
    def __init__(self, backends: Backends, interval_s: float, timeout_s: float, misses: int) -> None:
        self.backends = backends
        self.interval_s, self.timeout_s, self.misses = interval_s, timeout_s, misses
        self.state = {url: ProbeState() for url in backends.urls}

    async def probe(self, url: str) -> str | None:
        """Why ``url`` failed one probe, or None when it answered in time."""
        st = self.state[url]
        client, headers = self.backends.client, self.backends.headers(url)
        timeout = httpx.Timeout(self.timeout_s)
        try:
            if not st.use_models:
                r = await client.get(health_url(url), headers=headers, timeout=timeout)
                if r.is_success:
                    return None
                if r.status_code not in _NOT_THERE:
                    return f"/health answered {r.status_code}"
                st.use_models = True
            r = await client.get(f"{url}/models", headers=headers, timeout=timeout)
            return None if r.is_success else f"/v1/models answered {r.status_code}"
        except httpx.TimeoutException:
            return f"no answer in {self.timeout_s:g} s"
        except httpx.HTTPError as exc:
            return type(exc).__name__

    async def round(self) -> None:
        """Probe every backend at once and apply the verdicts."""
        verdicts = await asyncio.gather(*(self.probe(url) for url in self.state))
        recovered = False
        for url, why in zip(self.state, verdicts, strict=True):
            st = self.state[url]
            was_down = url in self.backends.down
            if why is None:
                st.misses, st.last_error = 0, ""
                self.backends.mark(url, up=True)
                if was_down:
                    recovered = True
                    log.warning("backend %s answers its health probe again: marked up", url)
                continue
            st.misses += 1
            st.last_error = why
            if st.misses >= self.misses and not was_down:
                self.backends.mark(url, up=False)
                log.error("backend %s marked down after %d failed probes (%s)", url, st.misses, why)
        if recovered:  # its models may have changed while it was away
            await self.backends.list_models()

    async def run(self) -> None:
        """Probe now (a backend down at start is known at once), then a round every ``interval_s``
        (a round that waited for timeouts does not push the next one back)."""
        loop = asyncio.get_running_loop()
        while True:
            start = loop.time()
            try:
                await self.round()
            except Exception:
                log.exception("backend health probes failed")
            await asyncio.sleep(max(0.0, self.interval_s - (loop.time() - start)))
