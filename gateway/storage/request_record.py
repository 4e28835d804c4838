"""One request through the gateway, as the request log keeps it: created once per request, filled as
the request moves on, mapped to the ORM row (``tables.RequestRow``) here and nowhere else, and read
back by attribute (feedback, the recorder's recent rows).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cachegw.gateway.storage.tables import RequestRow


# How the cache answered a request. The values are wire values: the ``x-cache`` header, the request
# log's ``cache_result`` column, the stats API and the dashboard all carry them, so they never change.
class CacheResult(enum.StrEnum):
    EXACT_HIT = "exact-hit"
    SEMANTIC_HIT = "semantic-hit"
    MISS = "miss"  # looked up, not found: the backend answered
    BYPASS = "bypass"  # not looked up (cacheability, cache disabled): the backend answered


HITS = frozenset({CacheResult.EXACT_HIT, CacheResult.SEMANTIC_HIT})
NOT_HITS = frozenset({CacheResult.MISS, CacheResult.BYPASS})  # answered by a backend


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
    api: str | None = "chat"  # the route's API: chat, completions, responses, messages, embeddings
    route: str | None = None  # routing = "kv": why the backend was picked (prefix, load, hash)
    expected_cached_tokens: int | None = None  # routing = "kv": the prefix the picked backend held

    @property
    def is_hit(self) -> bool:
        return self.cache_result in (CacheResult.EXACT_HIT, CacheResult.SEMANTIC_HIT)

    def to_row(self) -> RequestRow:
        return RequestRow(**{name: getattr(self, name) for name in COLUMNS})

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> RequestRecord:
        """From a request-log row given as a dict of its columns (unknown keys are a TypeError)."""
        record = cls(**values)
        record.cache_result = result_of(record.cache_result)
        return record

    @classmethod
    def from_columns(cls, values: Sequence[Any]) -> RequestRecord:
        """From the columns in field order (``COLUMNS``), as a query of them returns each row: the
        quick way for the millions of rows a report may read (about 1 us a row)."""
        record = cls(*values)
        record.cache_result = result_of(record.cache_result)
        return record

    @classmethod
    def from_row(cls, row: RequestRow) -> RequestRecord:
        return cls.from_columns([getattr(row, name) for name in COLUMNS])


COLUMNS = tuple(f.name for f in dataclasses.fields(RequestRecord))
_RESULTS = {r.value: r for r in CacheResult}


def result_of(value: str) -> CacheResult:
    """The enum member of a stored value (a dict look-up: faster than ``CacheResult(value)``)."""
    try:
        return _RESULTS[value]
    except KeyError:
        raise ValueError(f"not a cache result: {value!r}") from None
