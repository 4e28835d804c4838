"""One request through the gateway, as the request log keeps it: created once per request, filled as
the request moves on, mapped to the ORM row (``tables.RequestRow``) here and nowhere else, and read
back by attribute (feedback, the recorder's recent rows).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.cache_result import CacheResult
from gateway.tables import RequestRow


@dataclass(slots=True)
class RequestRecord:
    id: str  # the x-request-id
    ts: float  # wall clock, when the request was recorded
    tenant: str  # the tenant's id (a key hash)
    model: str
    endpoint: str  # "chat" | "completions"
    stream: bool
    cache_result: CacheResult = CacheResult.BYPASS
    similarity: float | None = None  # of the hit, or of the nearest neighbour on a miss
    threshold: float | None = None
    entry_id: int | None = None  # the entry a hit served
    rules_fired: str = ""  # canonicalization rules, comma-separated
    volatile: str | None = None  # volatile values moved: "pattern:N" or "learned:<template>[label]"
    reason: str | None = None  # the x-cache-reason header
    embed_ms: float | None = None
    lookup_ms: float | None = None
    backend_ms: float | None = None
    backend: str | None = None  # the one that answered a miss
    total_ms: float = 0.0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None  # the backend's prefix-cache hits
    status: int = 200
    error: str | None = None
    response_id: str | None = None  # the body's "id" (the backend's on a miss)
    stored_entry_id: int | None = None  # a miss stored as this entry
    scope: str | None = None
    system_hash: str | None = None
    query_hash: str | None = None
    query: str | None = None  # the start of the last user message, if configured

    @property
    def is_hit(self) -> bool:
        return self.cache_result in (CacheResult.EXACT_HIT, CacheResult.SEMANTIC_HIT)

    def to_row(self) -> RequestRow:
        return RequestRow(**{f.name: getattr(self, f.name) for f in FIELDS})

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> RequestRecord:
        """From a request-log row given as a dict of its columns (unknown keys are a TypeError)."""
        return cls(**{**values, "cache_result": CacheResult(values["cache_result"])})

    @classmethod
    def from_row(cls, row: RequestRow) -> RequestRecord:
        values = {f.name: getattr(row, f.name) for f in FIELDS}
        return cls(**values | {"cache_result": CacheResult(row.cache_result)})


FIELDS = dataclasses.fields(RequestRecord)
