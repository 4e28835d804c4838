"""The request log's typed record: its wire values, and one mapping to the ORM row and back (real SQLite)."""

from __future__ import annotations

import asyncio
import time

from cachegw.gateway.cache.lookup import Lookup
from cachegw.gateway.request.flow import Flow
from cachegw.gateway.request.tenants import Tenant
from cachegw.gateway.storage.admin_store import AdminStore
from cachegw.gateway.storage.entry_ids import EntryIds
from cachegw.gateway.storage.recorder import Recorder, SqlRequestLog
from cachegw.gateway.storage.request_record import CacheResult
from cachegw.gateway.storage.store import Store
from cachegw.policies.cache_keys import request_keys
from cachegw.policies.cacheability import OK


def test_cache_results_keep_their_wire_values():
    """x-cache, the log's cache_result and the dashboard read these strings: they never change."""
    assert [r.value for r in CacheResult] == ["exact-hit", "semantic-hit", "miss", "bypass"]
    assert f"{CacheResult.SEMANTIC_HIT}" == "semantic-hit"


def test_a_flow_fills_its_record_and_it_reads_back_by_attribute(tmp_path):
    store = Store(f"sqlite:///{tmp_path / 'log.db'}")
    body = {"messages": [{"role": "user", "content": "What is  2+2?"}], "stream": True, "temperature": 0}
    flow = Flow.begin("chat", Tenant(id="tid", name="acme", cache_key="ck"), "m", body, OK)
    flow.keys = request_keys("ck", "m", "chat", body)
    flow.lookup = Lookup(
        CacheResult.MISS, similarity=0.5, threshold=0.9, lookup_ms=1.5, reason="below-threshold"
    )
    flow.record.cache_result, flow.record.reason = CacheResult.MISS, "below-threshold"
    flow.record.response_id = "chatcmpl-1"
    usage = {"prompt_tokens": 12, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 8}}
    record = flow.close(200, usage, None, log_query=True)
    assert (record.stream, record.similarity, record.cached_tokens, record.query) == (
        True,
        0.5,
        8,
        "What is  2+2?",
    )
    headers = flow.headers(EntryIds("admin-token"))
    assert (headers["x-cache"], headers["x-cache-reason"], headers["x-request-id"]) == (
        "miss",
        "below-threshold",
        record.id,
    )
    recorder = Recorder(SqlRequestLog(store.session), per_request=True)
    asyncio.run(recorder.record(record))
    assert recorder.recent("chatcmpl-1") is record
    back = AdminStore(store.session).find_request("chatcmpl-1")
    assert back == record and back.cache_result is CacheResult.MISS
    rows = AdminStore(store.session).requests(0.0, time.time() + 1)
    assert rows == [record]
    store.close()
