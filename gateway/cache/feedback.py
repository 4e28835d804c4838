"""Bad-hit feedback: find what answered a request, and make the cache stop giving that answer.

A tenant may flag only its own requests, or an entry by the x-cache-entry id it was shown (another
tenant's id is answered 404, as if unknown, so ids leak nothing); an admin may flag any request, or
an entry directly.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from cachegw.gateway.bodies import StrictBody, parse_body
from cachegw.gateway.cache.audits import Auditor
from cachegw.gateway.cache.response_cache import ResponseCache
from cachegw.gateway.metrics import GatewayMetrics
from cachegw.gateway.storage.admin_store import AdminStore
from cachegw.gateway.storage.entry_ids import EntryIds
from cachegw.gateway.storage.recorder import Recorder
from cachegw.gateway.storage.request_record import CacheResult, RequestRecord
from cachegw.gateway.storage.tables import MAX_ID
from cachegw.protocol.errors import ApiError

RequestId = Annotated[str, Field(min_length=1, max_length=256)]


class FeedbackBody(StrictBody):
    """POST /v1/cache/feedback and /admin/api/feedback. ``entry_id`` is the ``x-cache-entry`` id a hit
    carried; the admin API also takes the database's integer id."""

    verdict: Literal["bad"]
    request_id: RequestId | None = None
    entry_id: Annotated[int, Field(ge=1, le=MAX_ID)] | Annotated[str, Field(max_length=64)] | None = None

    @field_validator("request_id")
    @classmethod
    def _encodable(cls, value: str | None) -> str | None:
        """A string a database can look up: no lone surrogate (JSON allows one)."""
        if value is not None:
            try:
                value.encode()
            except UnicodeEncodeError:
                raise ValueError("not a valid Unicode string") from None
        return value


def parse_feedback(body: Any, admin: bool) -> tuple[str | None, int | str | None]:
    """(request_id, entry_id) from the JSON body, or a 400 that names the field."""
    fb = parse_body(FeedbackBody, body, "The request body", param_of=lambda loc: str(loc[0]))
    if fb.request_id is None and fb.entry_id is None:
        raise ApiError(400, "Missing required parameter: request_id or entry_id.", param="request_id")
    if not admin and isinstance(fb.entry_id, int):
        raise ApiError(400, "entry_id must be the x-cache-entry header of a hit.", param="entry_id")
    return fb.request_id, fb.entry_id


def resolve_entry(entry_ids: EntryIds, entry_id: int | str, tenant: str | None) -> int:
    """The database id behind an x-cache-entry id (or, for an admin, an integer id); a 404 for an id
    the caller was never shown, as for one that does not exist."""
    if isinstance(entry_id, int):
        return entry_id
    found = entry_ids.decode(tenant, entry_id) if tenant else entry_ids.decode_any(entry_id)
    if found is None and tenant is None and not entry_ids.looks_opaque(entry_id):
        raise ApiError(400, "entry_id must be an integer or an x-cache-entry id.", param="entry_id")
    if found is None:
        raise ApiError(404, f"No cache entry '{entry_id}'.", param="entry_id", code="not_found")
    return found


class BadHitReports:
    """Turns a report of a bad answer into the cache's action on the entry, logged and audited."""

    def __init__(
        self,
        cache: ResponseCache,
        admin: AdminStore,
        recorder: Recorder,
        entry_ids: EntryIds,
        metrics: GatewayMetrics,
        auditor: Auditor | None = None,
    ) -> None:
        self.cache, self.admin, self.recorder = cache, admin, recorder
        self.entry_ids, self.metrics = entry_ids, metrics
        self.auditor = auditor

    async def _find_request(self, request_id: str) -> RequestRecord | None:
        return self.recorder.recent(request_id) or await asyncio.to_thread(
            self.admin.find_request, request_id
        )

    async def report_bad(
        self, actor: str, request_id: str | None, entry_id: int | str | None, tenant: str | None
    ) -> dict[str, Any]:
        """Flag a bad answer; ``tenant`` is the caller's tenant id (None for an admin). A tenant is
        answered with the entry's x-cache-entry id, never the database's counter."""
        record = None
        similarity, result, whole_entry = None, None, True
        if request_id is not None:
            record = await self._find_request(request_id)
            if record is None or (tenant is not None and record.tenant != tenant):
                raise ApiError(
                    404, f"No request with id '{request_id}'.", param="request_id", code="not_found"
                )
            result = record.cache_result
            if record.is_hit:
                entry_id, similarity = record.entry_id, record.similarity
                whole_entry = result == CacheResult.EXACT_HIT
            elif record.stored_entry_id:
                entry_id = record.stored_entry_id  # the backend's answer, stored: wrong for its own query
            else:
                raise ApiError(
                    409,
                    f"Request '{request_id}' was neither answered from the cache nor stored in it.",
                    param="request_id",
                    code="not_cached",
                )
        elif entry_id is not None:
            entry_id = resolve_entry(self.entry_ids, entry_id, tenant)
        assert isinstance(entry_id, int)
        shown: int | str = entry_id if tenant is None else self.entry_ids.encode(tenant, entry_id)
        flagged = await self.cache.flag_bad(entry_id, similarity, whole_entry)
        if flagged is None:
            raise ApiError(
                404, f"No cache entry '{shown}' (deleted or expired).", param="entry_id", code="not_found"
            )
        entry, action = flagged
        row = {
            "request_id": record.id if record else None,
            "entry_id": entry_id,
            "tenant": record.tenant if record else (tenant if tenant else entry.tenant),
            "actor": actor,
            "verdict": "bad",
            "cache_result": result.value if result is not None else None,
            "similarity": similarity,
            "query": record.query if record else None,
            "entry_query": entry.query_text,
            "action": action,
        }
        audit = {
            "actor": actor,
            "action": "feedback.bad",
            "target": f"entry {entry_id}",
            "new": {"action": action},
        }
        feedback_id = await asyncio.to_thread(self.admin.add_feedback, row, audit)
        if result == CacheResult.SEMANTIC_HIT and record is not None and self.auditor is not None:
            await self.auditor.bad_report(record.id)  # wrong-hit evidence for the false-hit bound
        self.metrics.feedback.inc()
        if tenant is not None:  # global counters (entry and feedback ids) would tell of other tenants
            return {**row, "entry_id": shown}
        return {"id": feedback_id, **row}
