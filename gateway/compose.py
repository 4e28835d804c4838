"""The composition root: every part of the gateway built once, in one place, and handed only what it
needs; started in order and stopped in reverse. The HTTP layer reads the result (``Parts``) through
its dependencies; ``gateway/serve.py`` runs it under uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Callable

from cachegw.embeddings.batcher import EmbeddingBatcher
from cachegw.embeddings.encoder import make_encoder
from cachegw.embeddings.index import ScopedIndex
from cachegw.embeddings.memo import PairScores
from cachegw.gateway.cache.audits import Auditor
from cachegw.gateway.cache.error_control import ThresholdProvider
from cachegw.gateway.cache.feedback import BadHitReports
from cachegw.gateway.cache.follow import Follower
from cachegw.gateway.cache.maintenance import HIT_FLUSH_S
from cachegw.gateway.cache.prior_loader import load_priors
from cachegw.gateway.cache.response_cache import ResponseCache
from cachegw.gateway.cache.retention import RETENTION_EVERY_S, Retention
from cachegw.gateway.cache.sync import OnAnyChange
from cachegw.gateway.cache.verifier_loader import load_verifier
from cachegw.gateway.config import BackendSpec, Settings
from cachegw.gateway.live_settings import LiveSettings
from cachegw.gateway.metrics import BackendCounts, GatewayMetrics
from cachegw.gateway.parts import Parts
from cachegw.gateway.request.admin_auth import AdminAuth, resolve_admin_token
from cachegw.gateway.request.embeddings import Embeddings
from cachegw.gateway.request.pipeline import Gateway
from cachegw.gateway.request.rate_limits import RateLimiter
from cachegw.gateway.request.tenants import PrefixSalts, Tenants
from cachegw.gateway.request.tracing import Tracing
from cachegw.gateway.request.volatile_learner import VolatileLearner
from cachegw.gateway.storage.admin_store import AdminStore
from cachegw.gateway.storage.changes import ChangeKind
from cachegw.gateway.storage.entry_ids import EntryIds
from cachegw.gateway.storage.evidence_store import EvidenceStore
from cachegw.gateway.storage.notify import ChangeListener, listens
from cachegw.gateway.storage.pgvector_index import PgVectorIndex
from cachegw.gateway.storage.rate_store import RateStore
from cachegw.gateway.storage.recorder import Recorder, SqlRequestLog
from cachegw.gateway.storage.responses_store import ResponsesStore
from cachegw.gateway.storage.store import Store, sql_stores
from cachegw.gateway.storage.volatile_store import VolatileStore
from cachegw.gateway.upstream.health import HealthProbes
from cachegw.gateway.upstream.proxy import Backends
from cachegw.gateway.upstream.supervisor import BuiltinBackend
from cachegw.policies.verifier import Verifier

log = logging.getLogger("cachegw.gateway")
EXPIRY_EVERY_S = 60.0
SETTINGS_POLL_S = 5.0  # settings another replica changed, without a sync (sync_interval_s = 0)
DISCOVER_EVERY_S = 30.0  # how soon a backend that was down at start (or added a model) gets traffic


@contextlib.asynccontextmanager
async def started_gateway(
    settings: Settings,
    progress: bool = True,
    clock: Callable[[], float] = time.time,
    engine_cpus: frozenset[int] | None = None,
    tracing: Tracing | None = None,
) -> AsyncIterator[Parts]:
    """Every part of the gateway, built once, started in order, stopped in reverse; ``clock`` is the cache's
    wall clock (expiry, freshness), which tests move instead of sleeping; ``engine_cpus`` the built-in
    engine's cores (``split_cores``); ``tracing`` a tracer of the caller's (else ``[gateway]
    otlp_endpoint``'s, which is flushed at the end)."""
    data_dir = settings.data_dir
    data_dir.mkdir(parents=True, exist_ok=True)
    database_url = settings.gateway.resolved_database_url(data_dir)
    store = Store(database_url, clock)
    stores = sql_stores(store)  # the entries, replies and change feed (gateway/storage/interfaces.py)
    live = LiveSettings(settings, AdminStore(store.session))
    settings = await asyncio.to_thread(live.load)  # run-time changes saved earlier win over the file
    admin_token = resolve_admin_token(settings.admin.token, data_dir)
    c = settings.cache
    # exported to ONNX on the first start (seconds), so off the event loop
    enc = c.encoder
    encoder = await asyncio.to_thread(
        make_encoder, enc.backend, enc.threads, None, settings.engine.resolved_cache_dir, enc.int8
    )
    batcher = EmbeddingBatcher(encoder, window_ms=c.encoder.batch_window_ms, max_batch=c.encoder.max_batch)
    await asyncio.to_thread(encoder.encode, ["warm-up"])
    # loaded even when switched off: the admin API can switch it on at run time
    verifier = await asyncio.to_thread(load_verifier, c, settings.engine.resolved_cache_dir)
    if verifier.cross is not None and c.model_memo_entries:  # a repeated pair is not scored again
        verifier = Verifier(verifier.params, verifier.meta, PairScores(verifier.cross, c.model_memo_entries))
    index = await asyncio.to_thread(vector_index, settings, store, encoder.dim)
    evidence = EvidenceStore(store.session)
    priors = await asyncio.to_thread(load_priors, c.error_bound.false_hit_prior)
    lines = ThresholdProvider(evidence, clock, c.error_bound.ageing, priors)
    cache = ResponseCache(live.cache_settings, stores, index, batcher, verifier, lines)
    n = await asyncio.to_thread(cache.rebuild_index, progress)  # follows the change log from here on
    log.info("cache: %d entries, %d in the vector index", cache.entries, n)
    await asyncio.to_thread(lines.load)  # the false-hit evidence every replica wrote
    builtin = None
    specs: list[BackendSpec | str] = list(settings.gateway.backends)
    if not specs:
        port = settings.backend_server.port
        stop_s = settings.engine.kv_shutdown_budget_s + 10  # its KV tier written, then its exit
        builtin = BuiltinBackend("127.0.0.1", port, settings.config_path, engine_cpus, stop_timeout_s=stop_s)
        await builtin.start()
        specs = [BackendSpec(url=builtin.url, drafts=True, pins=True)]
    g = settings.gateway
    retry_after = max(1, math.ceil(g.probe_interval_s))  # a down backend is re-checked that soon
    backends = Backends(
        specs, g.connect_timeout_s, g.backend_timeout_s, g.routing, retry_after,
        kv_load_penalty=g.kv_load_penalty, kv_metrics_interval_s=g.kv_metrics_interval_s,
        kv_tier_weight=g.kv_tier_weight,
    )  # fmt: skip
    probes = HealthProbes(backends, g.probe_interval_s, g.probe_timeout_s, g.probe_misses)
    auditor = Auditor(
        lines, backends, batcher, live.cache_settings, clock, builtin_backend=builtin is not None
    )
    metrics = GatewayMetrics(
        lambda: float(cache.entries),
        BackendCounts(backends.answered, backends.refused, backends.urls, backends.down),
        index_entries=lambda: float(len(cache.index)),
        sync_age=(lambda: time.time() - cache.synced_at) if c.sync_interval_s else None,
    )
    if (kv := backends.kv) is not None:  # routing = "kv": what each backend holds and its load, followed
        kv.start()
        metrics.watch_kv(kv.indexed_blocks, lambda: dict(kv.load.load), kv.lost, kv.tiered_blocks)
    metrics.watch_audits(
        auditor.counts, lambda: auditor.backend_tokens, lambda: lines.view(live.current.cache)
    )
    request_log = SqlRequestLog(store.session)
    recorder = Recorder(request_log, per_request=settings.gateway.request_log_commit == "per_request")
    admin = AdminStore(store.session)
    retention = Retention(request_log, admin, evidence, settings, lines.ageing, clock)
    tenants = Tenants(settings.tenants)
    entry_ids = EntryIds(admin_token)
    volatile = VolatileLearner(
        store=VolatileStore(store.session), config=lambda: live.current.canonicalize.learn
    )
    n = await asyncio.to_thread(volatile.load)  # the templates every replica learned: start warm
    log.info("volatile spans: %d learned template(s) stored", n)
    # what the change log names beside the entries: each read as another replica writes it
    cache.replicas.follow(ChangeKind.SETTINGS, OnAnyChange(live.refresh))
    cache.replicas.follow(ChangeKind.EVIDENCE, lines)
    cache.replicas.follow(ChangeKind.TEMPLATE, volatile)
    responses = ResponsesStore(store.session, clock)
    retention_s = settings.gateway.responses_retention_days * 86400
    limits = RateLimiter(settings.tenants, RateStore(store.session), clock)
    own_tracing = tracing is None
    tracing = tracing or Tracing.configured(settings.gateway.otlp_endpoint)
    pipeline = Gateway(
        live,
        tenants,
        volatile,
        cache,
        backends,
        stores.replies,
        metrics,
        recorder,
        PrefixSalts(admin_token),
        entry_ids,
        limits,
        auditor,
        tracing,
    )
    parts = Parts(
        live=live,
        pipeline=pipeline,
        embeddings=Embeddings(live, tenants, cache, backends, metrics, recorder, entry_ids),
        cache=cache,
        replies=stores.replies,
        admin=admin,
        backends=backends,
        tenants=tenants,
        auth=AdminAuth(admin_token),
        entry_ids=entry_ids,
        volatile=volatile,
        metrics=metrics,
        feedback=BadHitReports(cache, admin, recorder, entry_ids, metrics, auditor),
        auditor=auditor,
        responses=responses,
    )
    recorder.start()
    chores = [
        asyncio.create_task(_every(EXPIRY_EVERY_S, cache.expire), name="cachegw-expiry"),
        asyncio.create_task(
            _every(EXPIRY_EVERY_S, lambda: asyncio.to_thread(limits.prune)), name="cachegw-rates"
        ),
        asyncio.create_task(
            _every(EXPIRY_EVERY_S, lambda: asyncio.to_thread(responses.prune, retention_s)),
            name="cachegw-responses-retention",
        ),
        asyncio.create_task(
            _every(RETENTION_EVERY_S, lambda: asyncio.to_thread(retention.prune)), name="cachegw-retention"
        ),
        asyncio.create_task(_every(HIT_FLUSH_S, cache.flush_hits), name="cachegw-hits"),
        asyncio.create_task(_every(SETTINGS_POLL_S, live.refresh), name="cachegw-settings"),
        asyncio.create_task(_every(DISCOVER_EVERY_S, backends.list_models), name="cachegw-discovery"),
        asyncio.create_task(probes.run(), name="cachegw-backend-health"),
        asyncio.create_task(auditor.run(), name="cachegw-audits"),
    ]
    if c.sync_interval_s > 0:  # other replicas' entries, flags, deletions, settings, evidence, templates
        follower = Follower(lambda: _sync_all(cache, volatile), c.sync_interval_s)
        chores.append(asyncio.create_task(follower.run(), name="cachegw-sync"))
        if listens(database_url):  # PostgreSQL: at once on each commit, the poll as a safety net
            listener = ChangeListener(database_url, follower.wake)
            chores.append(asyncio.create_task(listener.run(), name="cachegw-listener"))
    try:
        yield parts
    finally:
        for task in chores:
            task.cancel()
        await cache.flush_hits()
        if isinstance(index, ScopedIndex):  # the next start reads them back
            saved = await asyncio.to_thread(index.save_snapshots)
            if saved:
                log.info("saved %d index snapshot(s) to %s", saved, data_dir / "index")
        await recorder.close()
        await backends.close()
        if builtin is not None:
            await builtin.stop()
        batcher.close()
        store.close()
        if own_tracing:
            await asyncio.to_thread(tracing.shutdown)  # the spans still buffered are exported


def vector_index(settings: Settings, store: Store, dim: int) -> ScopedIndex | PgVectorIndex:
    """The ``[index] store``: FAISS in this process, or pgvector in the database (nothing in memory,
    nothing to sync or snapshot: every replica searches the same table)."""
    ix = settings.index
    if ix.store == "pgvector":
        return PgVectorIndex(store.engine, dim, ix.ef_search, ix.hnsw_m, ix.ef_construction)
    return ScopedIndex(
        dim=dim,
        hnsw_threshold=ix.hnsw_threshold,
        hnsw_m=ix.hnsw_m,
        ef_construction=ix.ef_construction,
        ef_search=ix.ef_search,
        tombstone_ratio=ix.tombstone_ratio,
        snapshot_dir=settings.data_dir / "index" if ix.snapshots else None,
    )


async def _sync_all(cache: ResponseCache, volatile: VolatileLearner) -> None:
    await cache.sync()  # and, through the log, the settings, evidence and templates
    await volatile.flush_matches()


async def _every(seconds: float, chore) -> None:
    """Run ``chore`` every ``seconds``; a failure is logged and the next round goes on."""
    while True:
        await asyncio.sleep(seconds)
        try:
            await chore()
        except Exception:
            log.exception("%s failed", chore.__name__)
