"""How busy each backend is: sequences running and waiting, read from its Prometheus ``/metrics``.

The built-in engine exports ``cachegw:num_requests_running`` / ``cachegw:num_requests_waiting``,
vLLM ``vllm:num_requests_running`` / ``vllm:num_requests_waiting`` (one series per engine, summed).
Read every ``interval_s``; a backend that does not answer keeps its last reading, one never read
counts as idle (``routing = "kv"`` then weighs only what it holds).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable, Mapping

import httpx

log = logging.getLogger("cachegw.gateway")

_GAUGES = ("num_requests_running", "num_requests_waiting")


def server_root(url: str) -> str:
    """A backend's base URL without its ``/v1``: where /metrics and /tokenize live."""
    return url[: -len("/v1")] if url.endswith("/v1") else url


def queued_sequences(text: str) -> int:
    """Running + waiting sequences in a Prometheus text exposition (0 when it names neither)."""
    total = 0.0
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = re.split(r"[{ ]", line, maxsplit=1)[0]
        if name.rsplit(":", 1)[-1] in _GAUGES:
            try:
                total += float(line.rsplit(None, 1)[-1])
            except ValueError:
                continue
    return int(total)


class BackendLoad:
    """The latest load reading per backend, refreshed by ``run``."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        urls: list[str],
        headers: Callable[[str], Mapping[str, str]],
        interval_s: float,
    ) -> None:
        self._client, self._urls, self._headers = client, urls, headers
        self.interval_s = interval_s
        self.load: dict[str, int] = {}

    async def read(self, url: str) -> None:
        try:
            r = await self._client.get(
                f"{server_root(url)}/metrics", headers=dict(self._headers(url)), timeout=2.0
            )
            r.raise_for_status()
        except httpx.HTTPError:
            return
        self.load[url] = queued_sequences(r.text)

    async def run(self) -> None:
        while True:
            await asyncio.gather(*(self.read(u) for u in self._urls))
            await asyncio.sleep(self.interval_s)
