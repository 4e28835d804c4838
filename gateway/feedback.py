"""Bad-hit feedback: find what answered a request, and make the cache stop giving that answer.

A tenant may flag only its own requests (another tenant's id is answered 404, as if unknown, so
ids leak nothing); an admin may flag any request, or an entry directly.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from gateway.store import MAX_ID
from protocol.errors import ApiError

if TYPE_CHECKING:
    from gateway.app import Gateway

HIT_RESULTS = ("exact-hit", "semantic-hit")


def parse_feedback(body: Any, admin: bool) -> tuple[str | None, int | None]:
    """(request_id, entry_id) from the JSON body, or a 400 that says what is wrong."""
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    verdict = body.get("verdict")
    if verdict != "bad":
        raise ApiError(400, 'verdict must be "bad".', param="verdict")
    request_id = body.get("request_id")
    entry_id = body.get("entry_id") if admin else None
    if request_id is not None and not _id_text(request_id):
        raise ApiError(
            400, "request_id must be a non-empty string of at most 256 characters.", param="request_id"
        )
    if entry_id is not None and (isinstance(entry_id, bool) or not isinstance(entry_id, int)):
        raise ApiError(400, "entry_id must be an integer.", param="entry_id")
    if entry_id is not None and not 1 <= entry_id <= MAX_ID:
        raise ApiError(400, f"entry_id must be between 1 and {MAX_ID}.", param="entry_id")
    if request_id is None and entry_id is None:
        need = "request_id or entry_id" if admin else "request_id"
        raise ApiError(400, f"Missing required parameter: {need}.", param="request_id")
    return request_id, entry_id


def _id_text(value: Any) -> bool:
    """A string a database can look up: not empty, not huge, no lone surrogate (JSON allows one)."""
    if not isinstance(value, str) or not 0 < len(value) <= 256:
        return False
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


async def _find_request(gw: Gateway, request_id: str) -> dict[str, Any] | None:
    return gw.recorder.recent(request_id) or await asyncio.to_thread(gw.admin.find_request, request_id)


async def report_bad(
    gw: Gateway, actor: str, request_id: str | None, entry_id: int | None, tenant: str | None
) -> dict[str, Any]:
    """Flag a bad answer; ``tenant`` is the caller's tenant id (None for an admin)."""
    record = None
    similarity, result, whole_entry = None, None, True
    if request_id is not None:
        record = await _find_request(gw, request_id)
        if record is None or (tenant is not None and record["tenant"] != tenant):
            raise ApiError(404, f"No request with id '{request_id}'.", param="request_id", code="not_found")
        result = record["cache_result"]
        if result in HIT_RESULTS:
            entry_id, similarity = record["entry_id"], record["similarity"]
            whole_entry = result == "exact-hit"
        elif record.get("stored_entry_id"):
            entry_id = record["stored_entry_id"]  # the backend's answer, stored: wrong for its own query
        else:
            raise ApiError(
                409,
                f"Request '{request_id}' was neither answered from the cache nor stored in it.",
                param="request_id",
                code="not_cached",
            )
    assert entry_id is not None
    flagged = await gw.cache.flag_bad(entry_id, similarity, whole_entry)
    if flagged is None:
        raise ApiError(
            404, f"No cache entry {entry_id} (deleted or expired).", param="entry_id", code="not_found"
        )
    entry, action = flagged
    row = {
        "request_id": record["id"] if record else None,
        "entry_id": entry_id,
        "tenant": record["tenant"] if record else entry.tenant,
        "actor": actor,
        "verdict": "bad",
        "cache_result": result,
        "similarity": similarity,
        "query": record.get("query") if record else None,
        "entry_query": entry.query_text,
        "action": action,
    }
    audit = {
        "actor": actor,
        "action": "feedback.bad",
        "target": f"entry {entry_id}",
        "new": {"action": action},
    }
    feedback_id = await asyncio.to_thread(gw.admin.add_feedback, row, audit)
    gw.metrics.feedback.inc()
    return {"id": feedback_id, **row}
