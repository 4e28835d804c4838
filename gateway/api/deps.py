"""FastAPI dependencies: each route declares the parts it uses (``cache: CacheDep`` is ``Depends`` on a
provider of the cache), and the providers read them from the ``Parts`` the composition root
(``gateway/compose.py``) built, which the app's lifespan keeps in its state."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, TypeVar

from fastapi import Depends, Request

from cachegw.gateway.cache.audits import Auditor
from cachegw.gateway.cache.feedback import BadHitReports
from cachegw.gateway.cache.response_cache import ResponseCache
from cachegw.gateway.config import Settings
from cachegw.gateway.live_settings import LiveSettings
from cachegw.gateway.metrics import GatewayMetrics
from cachegw.gateway.parts import Parts
from cachegw.gateway.request.admin_auth import AdminAuth
from cachegw.gateway.request.embeddings import Embeddings
from cachegw.gateway.request.pipeline import Gateway
from cachegw.gateway.request.tenants import Tenants
from cachegw.gateway.request.volatile_learner import VolatileLearner
from cachegw.gateway.storage.admin_store import AdminStore
from cachegw.gateway.storage.entry_ids import EntryIds
from cachegw.gateway.storage.interfaces import ReplyStore
from cachegw.gateway.storage.responses_store import ResponsesStore
from cachegw.gateway.upstream.proxy import Backends
from cachegw.protocol.errors import ApiError

T = TypeVar("T")


def started(request: Request) -> Parts:
    parts = request.app.state.parts()
    if parts is None:
        raise ApiError(503, "The gateway is starting.", type="server_error", code="starting")
    return parts


def _part(get: Callable[[Parts], T]) -> Callable[[Request], Awaitable[T]]:
    """A provider of one part of the started gateway. A coroutine, so FastAPI calls it on the event
    loop: a plain function would be sent to its thread pool, a thread hop for every request."""

    async def provide(request: Request) -> T:
        return get(started(request))

    return provide


PipelineDep = Annotated[Gateway, Depends(_part(lambda p: p.pipeline))]
EmbeddingsDep = Annotated[Embeddings, Depends(_part(lambda p: p.embeddings))]
# what is stored, and the cache over it
CacheDep = Annotated[ResponseCache, Depends(_part(lambda p: p.cache))]
StoreDep = Annotated[ReplyStore, Depends(_part(lambda p: p.replies))]
AdminStoreDep = Annotated[AdminStore, Depends(_part(lambda p: p.admin))]
ResponsesDep = Annotated[ResponsesStore, Depends(_part(lambda p: p.responses))]
ReportsDep = Annotated[BadHitReports, Depends(_part(lambda p: p.feedback))]
# the settings: in force (config.toml with run-time changes), and where changes go
SettingsDep = Annotated[Settings, Depends(_part(lambda p: p.live.current))]
LiveDep = Annotated[LiveSettings, Depends(_part(lambda p: p.live))]
# who is asking, and what each may see
TenantsDep = Annotated[Tenants, Depends(_part(lambda p: p.tenants))]
AuthDep = Annotated[AdminAuth, Depends(_part(lambda p: p.auth))]
EntryIdsDep = Annotated[EntryIds, Depends(_part(lambda p: p.entry_ids))]
# the rest of the gateway's state
VolatileDep = Annotated[VolatileLearner, Depends(_part(lambda p: p.volatile))]
MetricsDep = Annotated[GatewayMetrics, Depends(_part(lambda p: p.metrics))]
BackendsDep = Annotated[Backends, Depends(_part(lambda p: p.backends))]
AuditorDep = Annotated[Auditor | None, Depends(_part(lambda p: p.auditor))]
