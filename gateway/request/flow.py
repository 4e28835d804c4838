"""One request in flight: what the gateway works with, and the record it fills for the request log.

The record (``RequestRecord``) is created with the flow and filled as the request moves on; ``close``
adds what is known only at the end (status, tokens, times) and hands it to the recorder.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from configtools.logs import REQUEST_ID
from gateway.cache.lookup import Lookup
from gateway.request.tenants import Tenant
from gateway.storage.entry_ids import EntryIds
from gateway.storage.request_record import CacheResult, RequestRecord
from policies.cache_keys import RequestKeys
from policies.cacheability import Cacheability
from policies.canonical_text import normalize_for_match
from policies.canonicalize import Canonical

QUERY_CHARS = 500  # of the last user message kept in the request log (gateway.log_query_text)


def query_hash(query: str) -> str:
    """Groups repeats of one query in reports, whatever their whitespace or Unicode form."""
    return hashlib.sha256(normalize_for_match(query).encode()).hexdigest()[:16]


@dataclass
class Flow:
    record: RequestRecord
    tenant: Tenant
    body: dict[str, Any]  # the canonical body once ``canonicalized``
    cacheable: Cacheability
    start: float = field(default_factory=time.perf_counter)
    keys: RequestKeys | None = None
    lookup: Lookup | None = None
    cache_salt: str | None = None  # sent upstream in place of the client's (prefix isolation)

    @classmethod
    def begin(
        cls, endpoint: str, tenant: Tenant, model: str, body: dict[str, Any], cacheable: Cacheability
    ) -> Flow:
        record = RequestRecord(
            id=f"req-{uuid.uuid4().hex}",
            ts=0.0,
            tenant=tenant.id,
            model=model,
            endpoint=endpoint,
            stream=bool(body.get("stream")),
            reason=cacheable.reason,  # x-cache-reason: the cacheability row, or the lookup's why
        )
        REQUEST_ID.set(record.id)  # JSON log lines of this request's task name it (configtools/logs.py)
        return cls(record, tenant, body, cacheable)

    def draft(self) -> str | None:
        """A refused near miss's stored answer as the backend's draft (``cachegw_draft``): the text of
        the nearest refused candidate's answer, if the lookup had one.

        A paraphrase the verifier would not serve is often answered with much the same text. The built-in
        engine verifies a draft in one forward pass per few tokens (speculative decoding), so the fresh
        answer comes faster where the model says the same and costs little where it does not; the answer
        itself is the model's either way. Only text answers make drafts: a tool call carries the other
        user's arguments, which the model would rarely repeat.
        """
        entry = self.lookup.refused if self.lookup is not None else None
        if entry is None:
            return None
        try:
            choice = json.loads(entry.response)["choices"][0]
        except (ValueError, KeyError, IndexError, TypeError):
            return None
        if not isinstance(choice, dict):
            return None
        message = choice.get("message")
        text = message.get("content") if isinstance(message, dict) else choice.get("text")
        return text if isinstance(text, str) and text else None

    def canonicalized(self, canon: Canonical) -> None:
        self.body = canon.body
        self.record.rules_fired = ",".join(canon.rules)
        self.record.volatile = "; ".join(dict.fromkeys(m.tag for m in canon.moved))[:512] or None

    def headers(self, entry_ids: EntryIds) -> dict[str, str]:
        r = self.record
        h = {"x-cache": r.cache_result.value, "x-cache-reason": r.reason or "", "x-request-id": r.id}
        lk = self.lookup
        if lk is not None and lk.similarity is not None:
            h["x-cache-similarity"] = f"{lk.similarity:.4f}"
        if lk is not None and lk.entry is not None:
            h["x-cache-entry"] = entry_ids.encode(self.tenant.id, lk.entry.id)  # opaque, per tenant
        return h

    def close(self, status: int, usage: dict, error: str | None, log_query: bool) -> RequestRecord:
        """The record, complete: ``log_query`` keeps the start of the query text."""
        r, lk, keys = self.record, self.lookup, self.keys
        details = usage.get("prompt_tokens_details") or {}
        query = keys.query if keys else None
        r.ts = time.time()
        r.total_ms = (time.perf_counter() - self.start) * 1e3
        if lk is not None:
            r.similarity, r.threshold, r.embed_ms, r.lookup_ms = (
                lk.similarity,
                lk.threshold,
                lk.embed_ms,
                lk.lookup_ms,
            )
            r.entry_id = lk.entry.id if lk.entry else None
        r.prompt_tokens = usage.get("prompt_tokens")
        r.completion_tokens = usage.get("completion_tokens")
        r.cached_tokens = details.get("cached_tokens")
        r.status, r.error = status, error
        if r.cache_result not in (CacheResult.MISS, CacheResult.BYPASS):
            r.response_id = r.id  # a hit's body carries the request id
        if keys is not None:
            r.scope, r.system_hash = keys.scope, keys.system
        r.query_hash = query_hash(query) if query else None
        r.query = query[:QUERY_CHARS] if query and log_query and not self.cacheable.keeps_nothing else None
        return r
