"""The response cache's parts on their own, without HTTP: the serving rules (pure), the exact tier,
the entry memo, and the settings provider every part reads (a real SQLite store, no encoder)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest

from cachegw.embeddings.index import ScopedIndex
from cachegw.gateway.cache.exact import ExactTier
from cachegw.gateway.cache.memo import EntryMemo
from cachegw.gateway.cache.response_cache import ResponseCache
from cachegw.gateway.config import load_settings
from cachegw.gateway.storage.store import Store, sql_stores
from cachegw.gateway.storage.tables import CacheEntry
from cachegw.policies.cache_keys import request_keys
from cachegw.policies.cacheability import UNKNOWN_LENGTH, Freshness, answer_length, unservable


@dataclass
class Answer:
    bad: bool = False
    expires_at: float = 1_000.0
    created_at: float = 0.0
    finish_reason: str = "stop"
    completion_tokens: int = 10
    max_tokens: int | None = None


@pytest.mark.parametrize(
    ("answer", "max_tokens", "fresh", "why"),
    [
        (Answer(), None, Freshness(), None),
        (Answer(), 10, Freshness(), None),
        (Answer(bad=True), None, Freshness(), "flagged"),
        (Answer(expires_at=100.0), None, Freshness(), "expired"),
        (Answer(), None, Freshness(max_age=50), "too-old"),
        (Answer(), None, Freshness(min_fresh=900), "too-old"),
        (Answer(), 9, Freshness(), "too-long"),
        (Answer(finish_reason="length", max_tokens=10), 10, Freshness(), None),
        (Answer(finish_reason="length", max_tokens=10), 20, Freshness(), "truncated"),
        (Answer(finish_reason="content_filter"), None, Freshness(), "not-servable"),
    ],
)
def test_unservable_names_why_a_stored_answer_may_not_serve(answer, max_tokens, fresh, why):
    assert unservable(answer, max_tokens, 200.0, fresh) == why


def test_answer_length_without_usage_is_only_what_the_limit_proves():
    assert answer_length({"completion_tokens": 7}, 100, "stop") == 7
    assert answer_length({}, 100, "stop") == 100
    assert answer_length({"completion_tokens": True}, None, "stop") == UNKNOWN_LENGTH
    assert answer_length({}, 100, "length") == UNKNOWN_LENGTH


def entry(key: str, now: float, **over) -> CacheEntry:
    fields = dict(tenant="t", model="m", endpoint="chat", scope="", exact_key=key, query_text="q",
                  response="{}", finish_reason="stop", completion_tokens=1, size_bytes=2,
                  created_at=now, expires_at=now + 600)  # fmt: skip
    return CacheEntry(**(fields | over))


def keys(text: str, max_tokens: int | None = None):
    body = {"messages": [{"role": "user", "content": text}], "temperature": 0, "max_tokens": max_tokens}
    return request_keys("t", "m", "chat", body)


async def test_exact_tier_serves_what_fits_and_learns_keys_it_did_not_know(tmp_path):
    url = f"sqlite:///{tmp_path / 'exact.db'}"
    db_here, db_there = Store(url), Store(url)
    here, there = sql_stores(db_here).entries, sql_stores(db_there).entries
    now = time.time()
    k = keys("hello")
    long_id = here.add_entry(entry(k.exact, now, completion_tokens=50))
    tier = ExactTier(here, EntryMemo(here))
    tier.rebuild()
    assert long_id in tier
    assert await tier.find("t", "m", keys("hello", max_tokens=20), now, Freshness()) is None  # too long
    assert (await tier.find("t", "m", k, now, Freshness())).id == long_id
    assert await tier.find("other", "m", k, now, Freshness()) is None  # another tenant's key
    other = keys("bye")
    new_id = there.add_entry(entry(other.exact, now))  # another replica's answer: not mirrored yet
    assert new_id not in tier
    assert (await tier.find("t", "m", other, now, Freshness())).id == new_id
    assert new_id in tier  # learned from the database
    tier.drop(new_id)
    assert new_id not in tier
    db_here.close()
    db_there.close()


async def test_entry_memo_keeps_the_most_recently_used(tmp_path):
    db = Store(f"sqlite:///{tmp_path / 'memo.db'}")
    store = sql_stores(db).entries
    now = time.time()
    ids = [store.add_entry(entry(f"k{i}", now)) for i in range(3)]
    memo = EntryMemo(store, size=2)
    assert set(await memo.get(ids[:2])) == set(ids[:2])
    await memo.get([ids[0]])  # now the most recent
    assert set(await memo.get([ids[2], 999_999])) == {ids[2]}  # an unknown id is not found
    assert ids[0] in memo and ids[1] not in memo and ids[2] in memo
    # the least recently used kept entry, asked with one only the database has: both found, and the
    # loaded one evicts the other kept entry, not the one just read
    memo.forget(ids[2])
    await memo.get([ids[1]])
    assert ids[0] in memo and ids[1] in memo  # ids[0] is the least recently used
    assert set(await memo.get([ids[0], ids[2]])) == {ids[0], ids[2]}
    assert ids[0] in memo and ids[1] not in memo and ids[2] in memo
    db.close()


async def test_every_part_reads_the_settings_in_force(tmp_path):
    """The cache reads its settings through a provider: a change applies without being assigned in."""
    db = Store(f"sqlite:///{tmp_path / 'live.db'}")
    stores = sql_stores(db)
    store = stores.entries
    base = load_settings(None).cache
    current = [base]
    cache = ResponseCache(lambda: current[0], stores, ScopedIndex(dim=4), None, None)
    assert cache.threshold("m", "acme") == base.threshold
    current[0] = base.model_copy(
        update={"thresholds_by_tenant": {"acme": 0.5}, "max_entries": 4, "exact": False}
    )
    assert (cache.threshold("m", "acme"), cache.threshold("m", "other")) == (0.5, base.threshold)
    answer = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                           "finish_reason": "stop"}]}  # fmt: skip
    for i in range(6):
        await cache.insert("t", "m", "chat", keys(f"q{i}"), None, answer, 60)
    assert cache.entries <= 4 and store.totals()[0] == cache.entries  # evicted under the new budget
    assert (await cache.lookup("t", "acme", "m", keys("q5"))).reason == "exact-only"  # exact tier off
    db.close()
