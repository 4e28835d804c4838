"""The admin API under /admin/api (JSON, in the OpenAPI schema) and the dashboard page at /admin.

Every API route needs the admin token; tenants' API keys never open it. Changes apply to the next
request, persist in the database and are written to the audit log with who made them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi import Path as PathParam
from fastapi.responses import HTMLResponse

from cachegw.gateway import live_settings
from cachegw.gateway.api import deps
from cachegw.gateway.api.deps import (
    AdminStoreDep,
    AuditorDep,
    CacheDep,
    EntryIdsDep,
    LiveDep,
    ReportsDep,
    SettingsDep,
    StoreDep,
    TenantsDep,
    VolatileDep,
)
from cachegw.gateway.cache.audits import Auditor
from cachegw.gateway.cache.error_control import history
from cachegw.gateway.cache.feedback import parse_feedback, resolve_entry
from cachegw.gateway.cache.response_cache import ResponseCache
from cachegw.gateway.config import CacheConfig, PricingConfig
from cachegw.gateway.request.tenants import Tenants
from cachegw.gateway.storage import stats
from cachegw.gateway.storage.admin_store import AdminStore, entry_view
from cachegw.gateway.storage.entry_ids import EntryIds
from cachegw.gateway.storage.request_record import RequestRecord
from cachegw.gateway.storage.tables import MAX_ID
from cachegw.protocol.errors import ApiError
from cachegw.protocol.http import read_limited_body
from cachegw.protocol.requests import load_json

DASHBOARD = Path(__file__).resolve().parent / "static" / "admin.html"
ADMIN_BODY_BYTES = 1 << 20


def actor(request: Request) -> str:
    """Who made a change, for the audit log: an optional x-admin-user and the client address."""
    user = (request.headers.get("x-admin-user") or "admin").strip()[:64] or "admin"
    host = request.client.host if request.client else "?"
    return f"{user}@{host}"


async def json_body(request: Request) -> Any:
    return load_json(await read_limited_body(request, ADMIN_BODY_BYTES) or b"null")


MAX_WINDOW_S = 366 * 86400  # every admin query reads at most a year of the log
MAX_POINTS = 10_000  # buckets of one time series


def _window(text: str, param: str = "window") -> float:
    try:
        seconds = stats.parse_window(text)
    except ValueError as exc:
        raise ApiError(400, str(exc), param=param) from exc
    if seconds > MAX_WINDOW_S:
        raise ApiError(400, f"{param} may be at most 366d (got {text!r}).", param=param)
    return seconds


def _stats_report(
    pricing: PricingConfig,
    tenant_name: Callable[[str], str],
    rows: list[RequestRecord],
    since: float,
    until: float,
    bucket_s: float,
) -> dict[str, Any]:
    """The aggregations of /admin/api/stats: pure, CPU-bound, run in a worker thread."""
    hour0 = since - since % 3600
    return {
        "overall": stats.summarize(rows, pricing),
        "by_model": {m: stats.summarize(r, pricing) for m, r in stats.group(rows, "model").items()},
        "by_tenant": {
            tenant_name(t): stats.summarize(r, pricing) for t, r in stats.group(rows, "tenant").items()
        },
        "by_backend": stats.by_backend(rows, pricing),
        "timeseries": {"bucket_s": bucket_s, "points": stats.timeseries(rows, since, until, bucket_s)},
        "per_hour": stats.timeseries(rows, hour0, until, 3600),
        "similarity": stats.similarity_histogram(rows),
        "reasons": stats.reasons(rows),
    }


async def false_hit_report(
    cache: ResponseCache, auditor: Auditor | None, c: CacheConfig, since: float, until: float, bucket_s: float
) -> dict[str, Any]:
    """Per scope and overall: the audited false-hit rate at the line in force, its interval, the
    audits by verdict and their backend cost, and the window's history (the dashboard's chart)."""
    lines = cache.lines
    if lines is None or auditor is None:
        return {}
    rows = await asyncio.to_thread(lines.store.since, since)
    points = await asyncio.to_thread(
        history, rows, since, until, bucket_s, c.error_bound.false_hit_confidence
    )
    return {
        **lines.view(c),
        "audits_by_verdict": {v: auditor.counts.get(v, 0) for v in ("right", "wrong", "failed", "dropped")},
        "audit_backend_tokens": await asyncio.to_thread(lines.store.backend_tokens),  # every replica's
        "audit_backend_requests": auditor.backend_requests,  # this replica's re-asks
        "history": points,
    }


def scope_threshold(cache: ResponseCache, tenants: Tenants, model: str, tenant: str) -> float:
    """The threshold in force for a model and a tenant given by name or key hash ("" = any)."""
    return cache.threshold(model, tenants.name_of(tenants.id_of(tenant)) if tenant else "")


def entry_path_id(entry_ids: EntryIds, text: str) -> int:
    """An entry named in a path: the database's integer id, or the x-cache-entry id a tenant was shown."""
    if text.isascii() and text.isdigit():
        if not 1 <= int(text) <= MAX_ID:
            raise ApiError(400, f"entry_id must be between 1 and {MAX_ID}.", param="entry_id")
        return int(text)
    return resolve_entry(entry_ids, text, None)


async def rows_for(
    admin: AdminStore, tenants: Tenants, window: str, tenant: str, model: str
) -> tuple[float, float, list[RequestRecord]]:
    until = time.time()
    since = until - _window(window)
    tenant_id = tenants.id_of(tenant) if tenant else ""
    return since, until, await asyncio.to_thread(admin.requests, since, until, tenant_id, model)


def check_token(request: Request, auth: deps.AuthDep) -> None:
    auth.check(request.headers.get("authorization"))


def admin_router() -> APIRouter:
    # as a dependency the token is checked before the parameters: a caller without it learns nothing
    router = APIRouter(prefix="/admin/api", tags=["admin"], dependencies=[Depends(check_token)])

    @router.get("/settings", summary="Settings in force (config.toml with run-time changes over it)")
    async def get_settings(live: LiveDep) -> dict[str, Any]:
        return {**live_settings.view(live.current), "version": live.version}

    @router.put("/settings", summary="Change settings; any part may be sent, the rest is kept")
    async def put_settings(request: Request, live: LiveDep, cache: CacheDep) -> dict[str, Any]:
        body = await json_body(request)
        new = await asyncio.to_thread(live.patch, body, actor(request))
        if cache.entries > new.cache.max_entries or cache.bytes > new.cache.max_bytes:
            await cache.evict()
        return {**live_settings.view(new), "version": live.version}

    @router.get("/stats", summary="Hit rates, latency, tokens and cost saved over a time window")
    async def get_stats(
        admin: AdminStoreDep,
        tenants: TenantsDep,
        cache: CacheDep,
        settings: SettingsDep,
        auditor: AuditorDep,
        window: str = "1h",
        bucket: str | None = None,
        tenant: str = "",
        model: str = "",
    ) -> dict[str, Any]:
        since, until, rows = await rows_for(admin, tenants, window, tenant, model)
        window_s = until - since
        bucket_s = _window(bucket, "bucket") if bucket else stats.auto_bucket(window_s)
        if window_s / bucket_s > MAX_POINTS:
            raise ApiError(400, "bucket is too small for this window (over 10,000 points).", param="bucket")
        flagged = await asyncio.to_thread(admin.flagged_request_ids, since)
        threshold = scope_threshold(cache, tenants, model, tenant)
        # thousands of buckets over many rows: off the event loop, so other callers never wait on it
        report = await asyncio.to_thread(
            _stats_report, settings.pricing, tenants.name_of, rows, since, until, bucket_s
        )
        return {
            "window": window,
            "since": since,
            "until": until,
            **report,
            "false_hit_rate": await false_hit_report(cache, auditor, settings.cache, since, until, bucket_s),
            "similarity": {**report["similarity"], "threshold": threshold},
            "cache": {"entries": cache.entries, "bytes": cache.bytes},
            "flagged": len(flagged),
        }

    @router.get("/whatif", summary="Hits and estimated false hits at a proposed threshold, from the log")
    async def whatif(
        admin: AdminStoreDep,
        tenants: TenantsDep,
        cache: CacheDep,
        threshold: float = Query(ge=0, le=1),
        window: str = "24h",
        tenant: str = "",
        model: str = "",
    ) -> dict[str, Any]:
        since, _, rows = await rows_for(admin, tenants, window, tenant, model)
        flagged = await asyncio.to_thread(admin.flagged_request_ids, since)
        current = scope_threshold(cache, tenants, model, tenant)
        at = await asyncio.to_thread(stats.threshold_sweep, rows, flagged, [current, threshold])
        curve = await asyncio.to_thread(stats.threshold_sweep, rows, flagged, stats.SWEEP)
        return {
            "requests": len(rows),
            "current": at[0],
            "proposed": at[1],
            "curve": curve,
        }

    @router.get("/entries", summary="Browse and search cache entries")
    async def list_entries(
        admin: AdminStoreDep,
        tenants: TenantsDep,
        query: str = "",
        tenant: str = "",
        model: str = "",
        scope: str = "",
        bad: bool | None = None,
        order: Literal["hits", "recent", "last_hit", "size"] = "hits",
        limit: int = Query(50, ge=1, le=1000),
        offset: int = Query(0, ge=0, le=MAX_ID),
    ) -> dict[str, Any]:
        tenant_key = tenants.cache_key_of(tenant) if tenant else ""
        total, data = await asyncio.to_thread(
            admin.search_entries, query, tenant_key, model, scope, bad, order, limit, offset
        )
        return {"total": total, "data": data}

    @router.get("/entries/{entry_id}", summary="One entry (integer id or x-cache-entry id), full response")
    async def get_entry(
        admin: AdminStoreDep, entry_ids: EntryIdsDep, entry_id: str = PathParam(max_length=64)
    ) -> dict[str, Any]:
        entry = await asyncio.to_thread(admin.get_entry, entry_path_id(entry_ids, entry_id))
        if entry is None:
            raise ApiError(404, f"No cache entry {entry_id}.", param="entry_id", code="not_found")
        return {**entry_view(entry, preview=1 << 20), "response": json.loads(entry.response)}

    @router.delete("/entries/{entry_id}", summary="Delete one entry (integer id or x-cache-entry id)")
    async def delete_entry(
        request: Request,
        admin: AdminStoreDep,
        cache: CacheDep,
        entry_ids: EntryIdsDep,
        entry_id: str = PathParam(max_length=64),
    ) -> dict[str, Any]:
        eid = entry_path_id(entry_ids, entry_id)
        removed = await cache.delete([eid])
        if not removed:
            raise ApiError(404, f"No cache entry {entry_id}.", param="entry_id", code="not_found")
        await asyncio.to_thread(admin.audit, actor(request), "entries.delete", f"entry {eid}")
        return {"deleted": removed}

    @router.delete("/entries", summary="Delete every entry of a tenant, model and/or scope")
    async def delete_entries(
        request: Request,
        admin: AdminStoreDep,
        tenants: TenantsDep,
        cache: CacheDep,
        tenant: str = "",
        model: str = "",
        scope: str = "",
    ) -> dict[str, Any]:
        if not (tenant or model or scope):
            raise ApiError(400, "Give tenant, model or scope (POST /admin/api/flush deletes everything).")
        tenant_key = tenants.cache_key_of(tenant) if tenant else ""
        ids = await asyncio.to_thread(admin.entry_ids, tenant_key, model, scope)
        removed = await cache.delete(ids)
        target = ",".join(
            f"{k}={v}" for k, v in (("tenant", tenant), ("model", model), ("scope", scope)) if v
        )
        await asyncio.to_thread(
            admin.audit, actor(request), "entries.delete", target, None, {"deleted": removed}
        )
        return {"deleted": removed}

    @router.post("/flush", summary="Delete every cache entry and every remembered reply")
    async def flush(
        request: Request, admin: AdminStoreDep, cache: CacheDep, store: StoreDep
    ) -> dict[str, Any]:
        ids = await asyncio.to_thread(admin.entry_ids)
        removed = await cache.delete(ids)
        await asyncio.to_thread(store.clear_replies)
        await asyncio.to_thread(admin.audit, actor(request), "flush", "all", None, {"deleted": removed})
        return {"deleted": removed}

    @router.get("/volatile", summary="Volatile spans learned from traffic: templates per tenant")
    async def volatile(learner: VolatileDep, tenants: TenantsDep) -> dict[str, Any]:
        return {
            "data": [
                {"tenant": tenants.name_of(tenant), "templates": [dataclasses.asdict(t) for t in views]}
                for tenant, views in learner.view().items()
            ]
        }

    @router.get("/audit", summary="Who changed what, newest first")
    async def audit(
        admin: AdminStoreDep,
        limit: int = Query(100, ge=1, le=1000),
        offset: int = Query(0, ge=0, le=MAX_ID),
    ) -> dict[str, Any]:
        return {"data": await asyncio.to_thread(admin.audit_log, limit, offset)}

    @router.get("/feedback", summary="Hits flagged bad, newest first")
    async def flagged(admin: AdminStoreDep, limit: int = Query(50, ge=1, le=1000)) -> dict[str, Any]:
        return {"data": await asyncio.to_thread(admin.feedback, limit)}

    @router.post("/feedback", summary="Flag a bad answer by request id or entry id")
    async def admin_feedback(request: Request, reports: ReportsDep) -> dict[str, Any]:
        request_id, entry_id = parse_feedback(await json_body(request), admin=True)
        return await reports.report_bad(actor(request), request_id, entry_id, tenant=None)

    return router


def dashboard_page() -> HTMLResponse:
    """The page holds no data and no secret: it asks for the token and calls the API with it."""
    return HTMLResponse(DASHBOARD.read_text(encoding="utf-8"), headers={"cache-control": "no-store"})
