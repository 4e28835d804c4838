"""`cachegw serve`: build the gateway's parts, start the built-in backend if needed, serve."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Callable

import uvicorn
from fastapi import FastAPI

from configtools.cpus import format_cpus
from embeddings.batcher import EmbeddingBatcher
from embeddings.encoder import make_encoder
from embeddings.index import ScopedIndex
from gateway.api.app import build_app
from gateway.api.metrics_http import metrics_app
from gateway.cache.audits import Auditor
from gateway.cache.error_control import ThresholdProvider
from gateway.cache.maintenance import HIT_FLUSH_S
from gateway.cache.response_cache import ResponseCache
from gateway.cache.verifier_loader import load_verifier
from gateway.config import BackendSpec, Settings
from gateway.live_settings import LiveSettings
from gateway.request.admin_auth import resolve_admin_token
from gateway.request.pipeline import Gateway
from gateway.storage.admin_store import AdminStore
from gateway.storage.evidence_store import EvidenceStore
from gateway.storage.store import Store
from gateway.upstream.health import HealthProbes
from gateway.upstream.proxy import Backends
from gateway.upstream.supervisor import BuiltinBackend, CoreSplit, split_cores

log = logging.getLogger("cachegw.gateway")
EXPIRY_EVERY_S = 60.0
SETTINGS_POLL_S = 5.0  # how soon a replica sees settings another one changed
DISCOVER_EVERY_S = 30.0  # how soon a backend that was down at start (or added a model) gets traffic


@contextlib.asynccontextmanager
async def started_gateway(
    settings: Settings,
    progress: bool = True,
    clock: Callable[[], float] = time.time,
    engine_cpus: frozenset[int] | None = None,
) -> AsyncIterator[Gateway]:
    """Everything a request needs, started in order and stopped in reverse; ``clock`` is the cache's
    wall clock (expiry, freshness), which tests move instead of sleeping; ``engine_cpus`` the built-in
    engine's cores (``split_cores``)."""
    data_dir = settings.data_dir
    data_dir.mkdir(parents=True, exist_ok=True)
    store = Store(settings.gateway.resolved_database_url(data_dir), clock)
    live = LiveSettings(settings, AdminStore(store.session))
    settings = await asyncio.to_thread(live.load)  # run-time changes saved earlier win over the file
    admin_token = resolve_admin_token(settings.admin.token, data_dir)
    c = settings.cache
    # exported to ONNX on the first start (seconds), so off the event loop
    encoder = await asyncio.to_thread(
        make_encoder, c.encoder.backend, c.encoder.threads, None, settings.engine.resolved_cache_dir
    )
    batcher = EmbeddingBatcher(encoder, window_ms=c.encoder.batch_window_ms, max_batch=c.encoder.max_batch)
    await asyncio.to_thread(encoder.encode, ["warm-up"])
    # loaded even when switched off: the admin API can switch it on at run time
    verifier = await asyncio.to_thread(load_verifier, c, settings.engine.resolved_cache_dir)
    ix = settings.index
    index = ScopedIndex(
        dim=encoder.dim,
        hnsw_threshold=ix.hnsw_threshold,
        hnsw_m=ix.hnsw_m,
        ef_construction=ix.ef_construction,
        ef_search=ix.ef_search,
        tombstone_ratio=ix.tombstone_ratio,
        snapshot_dir=data_dir / "index" if ix.snapshots else None,
    )
    lines = ThresholdProvider(EvidenceStore(store.session), clock, c.error_bound.ageing)
    await asyncio.to_thread(lines.load)  # the false-hit evidence every replica wrote
    cache = ResponseCache(lambda: live.current.cache, store, index, batcher, verifier, lines)
    n = await asyncio.to_thread(cache.rebuild_index, progress)
    log.info("cache: %d entries, %d in the vector index", cache.entries, n)
    builtin = None
    specs: list[BackendSpec | str] = list(settings.gateway.backends)
    if not specs:
        port = settings.backend_server.port
        builtin = BuiltinBackend("127.0.0.1", port, settings.config_path, engine_cpus)
        await builtin.start()
        specs = [BackendSpec(url=builtin.url, drafts=True)]
    g = settings.gateway
    retry_after = max(1, math.ceil(g.probe_interval_s))  # a down backend is re-checked that soon
    backends = Backends(specs, g.connect_timeout_s, g.backend_timeout_s, g.routing, retry_after)
    probes = HealthProbes(backends, g.probe_interval_s, g.probe_timeout_s, g.probe_misses)
    auditor = Auditor(
        lines, backends, batcher, lambda: live.current.cache, clock, builtin_backend=builtin is not None
    )
    gw = Gateway(live, store, cache, backends, admin_token, auditor)
    gw.metrics.watch_audits(
        auditor.counts, lambda: auditor.backend_tokens, lambda: lines.view(gw.settings.cache)
    )
    gw.recorder.start()
    chores = [
        asyncio.create_task(_every(EXPIRY_EVERY_S, cache.expire), name="cachegw-expiry"),
        asyncio.create_task(_every(HIT_FLUSH_S, cache.flush_hits), name="cachegw-hits"),
        asyncio.create_task(_every(SETTINGS_POLL_S, gw.refresh_settings), name="cachegw-settings"),
        asyncio.create_task(_every(DISCOVER_EVERY_S, backends.list_models), name="cachegw-discovery"),
        asyncio.create_task(probes.run(), name="cachegw-backend-health"),
        asyncio.create_task(auditor.run(), name="cachegw-audits"),
    ]
    if c.sync_interval_s > 0:  # other replicas' entries, flags, deletions and false-hit evidence
        chores.append(asyncio.create_task(_every(c.sync_interval_s, cache.sync), name="cachegw-sync"))
        chores.append(asyncio.create_task(_every(c.sync_interval_s, lines.sync), name="cachegw-evidence"))
    try:
        yield gw
    finally:
        for task in chores:
            task.cancel()
        await cache.flush_hits()
        saved = await asyncio.to_thread(index.save_snapshots)  # the next start reads them back
        if saved:
            log.info("saved %d index snapshot(s) to %s", saved, data_dir / "index")
        await gw.recorder.close()
        await backends.close()
        if builtin is not None:
            await builtin.stop()
        batcher.close()
        store.close()


async def _every(seconds: float, chore) -> None:
    """Run ``chore`` every ``seconds``; a failure is logged and the next round goes on."""
    while True:
        await asyncio.sleep(seconds)
        try:
            await chore()
        except Exception:
            log.exception("%s failed", chore.__name__)


def run_gateway(settings: Settings) -> None:
    import torch

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # httpx logs every request it sends at INFO: with health probes, a line per backend every few
    # seconds. Failures are logged by the gateway itself; uvicorn's access log shows the requests.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    # One-query embeddings are tiny: extra OpenMP threads only spin against the event loop (a
    # single-sentence encode took 80-260 ms with 2 threads on a busy 2-core machine, 13 ms with 1).
    torch.set_num_threads(settings.cache.encoder.threads)
    cores = CoreSplit(None, None)
    if not settings.gateway.backends:  # the gateway and its engine share this machine: split its cores
        cores = split_cores(settings.engine.cpus, frozenset(os.sched_getaffinity(0)))
    if cores.gateway is not None:  # before any worker thread starts: they inherit it
        os.sched_setaffinity(0, cores.gateway)
        log.info(
            "gateway on cores %s, the built-in engine on %s", *map(format_cpus, (cores.gateway, cores.engine))
        )
    # a database that cannot be opened stops the start with one line, not a lifespan traceback
    Store(settings.gateway.resolved_database_url(settings.data_dir)).close()
    app = build_app(lambda: started_gateway(settings, engine_cpus=cores.engine))
    g = settings.gateway
    log.info("gateway on http://%s:%d/v1 (data in %s)", g.host, g.port, settings.data_dir)
    log.info("dashboard on http://%s:%d/admin (admin token: see docs/admin.md)", g.host, g.port)
    if not g.metrics_port:
        uvicorn.run(app, host=g.host, port=g.port, log_level="info")
        return
    log.info("metrics on http://%s:%d/metrics only", g.metrics_host, g.metrics_port)
    asyncio.run(serve_with_metrics(app, settings))


async def serve_with_metrics(app: FastAPI, settings: Settings) -> None:
    """The gateway and its metrics listener in one process and loop; when one stops, so does the other.

    Each server catches SIGINT/SIGTERM while it runs and hands the signal on when it returns (uvicorn
    re-raises it), so a stop signal ends both."""
    g = settings.gateway
    main = uvicorn.Server(uvicorn.Config(app, host=g.host, port=g.port, log_level="info"))
    side = metrics_app(app.state.gateway)
    metrics = uvicorn.Server(
        # log_config None: a second logging setup would silence the main server's log
        uvicorn.Config(side, host=g.metrics_host, port=g.metrics_port, lifespan="off", log_config=None)
    )
    tasks = [asyncio.create_task(main.serve()), asyncio.create_task(metrics.serve())]
    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    main.should_exit = metrics.should_exit = True
    await asyncio.gather(*tasks)
