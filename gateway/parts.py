"""The parts of a started gateway, as one typed record: what the composition root
(``gateway/compose.py``) built, and what the HTTP layer's dependencies (``gateway/api/deps.py``) read.

Each part is built once and handed only what it needs; nothing reaches one part through another.
"""

from __future__ import annotations

from dataclasses import dataclass

from cachegw.gateway.cache.audits import Auditor
from cachegw.gateway.cache.feedback import BadHitReports
from cachegw.gateway.cache.response_cache import ResponseCache
from cachegw.gateway.config import Settings
from cachegw.gateway.live_settings import LiveSettings
from cachegw.gateway.metrics import GatewayMetrics
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


@dataclass(frozen=True)
class Parts:
    live: LiveSettings  # the settings in force (config.toml with run-time changes) and where changes go
    pipeline: Gateway  # one request through the stages
    embeddings: Embeddings  # /v1/embeddings: an exact entry per input
    cache: ResponseCache
    replies: ReplyStore  # the reply texts canonicalization restores (the admin API clears them)
    admin: AdminStore
    backends: Backends
    tenants: Tenants
    auth: AdminAuth
    entry_ids: EntryIds
    volatile: VolatileLearner
    metrics: GatewayMetrics
    feedback: BadHitReports
    auditor: Auditor | None
    responses: ResponsesStore  # the Responses API's stored responses

    @property
    def settings(self) -> Settings:
        return self.live.current
