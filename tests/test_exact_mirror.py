"""A bounded exact-key mirror (``[cache] exact_keys_in_memory``): a replica's memory stays flat as the
cache grows, and every stored answer is still an exact hit (a key the mirror dropped is one query).

Real SQLite store and response cache; the answers are stored as the gateway stores them."""

from __future__ import annotations

from pathlib import Path

from cachegw.embeddings.index import ScopedIndex
from cachegw.gateway.cache.response_cache import ResponseCache
from cachegw.gateway.config import load_settings
from cachegw.gateway.storage.request_record import CacheResult
from cachegw.gateway.storage.store import Store, sql_stores
from cachegw.policies.cacheability import ANY_AGE
from tests.test_replica_sync import answer, keys

CAP = 5


def cache_on(db: Store, cap: int) -> ResponseCache:
    config = load_settings(None).cache.updated({"verifier": False, "exact_keys_in_memory": cap})
    cache = ResponseCache(config, sql_stores(db), ScopedIndex(384, background=False), None, None)
    cache.rebuild_index(False)
    return cache


async def test_a_bounded_mirror_holds_its_newest_keys_and_every_answer_still_hits(tmp_path: Path) -> None:
    db = Store(f"sqlite:///{tmp_path / 'c.db'}")
    try:
        cache = cache_on(db, CAP)
        ids = [await cache.insert("t", "m", "chat", keys(f"question {i}"), None, answer(f"a{i}"), 600)
               for i in range(4 * CAP)]  # fmt: skip
        assert len(cache.exact) == CAP and cache.entries == 4 * CAP
        assert [i in cache.exact for i in ids] == [False] * (3 * CAP) + [True] * CAP  # the newest kept
        for i, entry_id in enumerate(ids):  # the dropped ones come back from the database
            found = await cache.lookup("t", "t", "m", keys(f"question {i}"), fresh=ANY_AGE)
            assert found.result is CacheResult.EXACT_HIT and found.entry is not None
            assert found.entry.id == entry_id
            assert len(cache.exact) <= CAP
        # a replica starting on the same database mirrors the newest keys only
        again = cache_on(db, CAP)
        assert len(again.exact) == CAP and all(i in again.exact for i in ids[-CAP:])
        unbounded = cache_on(db, 0)
        assert len(unbounded.exact) == 4 * CAP
    finally:
        db.close()
