"""Unknown model names: a 404 that does not cost a model listing of every backend on each request.

The backend is the small recording test server of testkit/servers.py (it counts the /v1/models calls it
is sent, which the built-in engine does not); the HTTP between them is real, the clock is injected.
"""

from __future__ import annotations

import asyncio

import pytest

from cachegw.gateway.upstream.proxy import RELIST_AFTER_S, Backends
from cachegw.protocol.errors import ApiError
from testkit.servers import Upstream, recording_upstream, serve_in_thread


def test_unknown_models_relist_the_backends_at_most_every_few_seconds() -> None:
    up = Upstream("known")
    now = [1000.0]

    async def scenario(url: str) -> None:
        backends = Backends([url], connect_timeout=5, read_timeout=30, clock=lambda: now[0])
        try:
            assert await backends.route("known") == [url]
            for i in range(20):
                with pytest.raises(ApiError) as err:
                    await backends.route(f"no-such-model-{i}")
                assert err.value.status == 404 and err.value.code == "model_not_found"
            assert len(up.requests("/v1/models")) == 1  # was one listing per unknown name
            up.model = "loaded-later"  # a model the backend serves since the last listing
            now[0] += RELIST_AFTER_S
            assert await backends.route("loaded-later") == [url]
            assert len(up.requests("/v1/models")) == 2
        finally:
            await backends.close()

    with serve_in_thread(recording_upstream(up)) as base:
        asyncio.run(scenario(f"{base}/v1"))
