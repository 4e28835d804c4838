"""One live cache entry per exact key: a no-cache refresh replaces the answer, a flag takes the key out of
service, a database holding copies is cleaned at start, and replicas agree, on SQLite and PostgreSQL.

The real gateway on a real database, driven by the real openai SDK. The backend is the small
OpenAI-compatible test server in tests/tool_server.py, not the built-in engine: the tests must tell
which backend call an answer came from, and the server numbers its answers ("Plain answer N"), where
the engine at temperature 0 gives the same words every time.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from sqlalchemy import func, select

from cachegw.gateway.storage.store import Store, sql_stores
from cachegw.gateway.storage.tables import LIVE_KEY_INDEX, CacheEntry, ChangeRow, RequestRow
from testkit.servers import serve_in_thread
from tests.test_admin import flagged_by_tenant
from tests.test_gateway import gateway, settings_for
from tests.test_shared_store import eventually, fresh_database, on_database, shared_url  # noqa: F401
from tests.tool_server import Calls, tool_backend

MODEL = "tools"


@pytest.fixture(scope="module")
def backend() -> Iterator[tuple[str, Calls]]:
    calls = Calls()
    with serve_in_thread(tool_backend(calls)) as url:
        yield f"{url}/v1", calls


def ask(url: str, question: str, **headers: str) -> tuple[str, dict[str, str]]:
    """(the answer's text, the response headers) of a JSON request with extra headers."""
    c = openai.OpenAI(base_url=f"{url}/v1", api_key="tenant-a", max_retries=0, timeout=60)
    raw = c.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": question}],
        temperature=0,
        extra_headers={k.replace("_", "-"): v for k, v in headers.items()},
    )
    return raw.parse().choices[0].message.content or "", dict(raw.headers)


def entry_of(url: str, headers: dict[str, str]) -> int:
    """The entry id that answered a hit, read from its request-log row (``x-cache-entry`` is opaque)."""
    store = Store(url)
    try:
        deadline = time.monotonic() + 10  # the request log is written in batches
        while True:
            with store.session() as s:
                entry_id = s.scalar(
                    select(RequestRow.entry_id).where(RequestRow.id == headers["x-request-id"])
                )
            if entry_id is not None or time.monotonic() > deadline:
                assert entry_id is not None, "the hit was not logged"
                return entry_id
            time.sleep(0.05)
    finally:
        store.close()


def live_rows(url: str) -> dict[str, list[tuple[int, str]]]:
    """exact key -> [(id, response)] of the live (not flagged) entries, from the database itself."""
    store = Store(url)
    try:
        with store.session() as s:
            rows = s.execute(
                select(CacheEntry.exact_key, CacheEntry.id, CacheEntry.response)
                .where(CacheEntry.bad.is_(False))
                .order_by(CacheEntry.id)
            ).all()
    finally:
        store.close()
    out: dict[str, list[tuple[int, str]]] = {}
    for key, entry_id, response in rows:
        out.setdefault(key, []).append((entry_id, response))
    return out


def key_of(url: str, entry_id: int) -> str:
    store = Store(url)
    try:
        [entry] = sql_stores(store).entries.get_entries([entry_id]).values()
        return entry.exact_key
    finally:
        store.close()


def test_a_no_cache_refresh_replaces_the_answer_of_its_key(backend, tmp_path) -> None:
    with gateway(settings_for(tmp_path, [backend[0]])) as url:
        db = f"sqlite:///{tmp_path / 'cachegw.db'}"
        old, h1 = ask(url, "What is a refresh?")
        new, h2 = ask(url, "What is a refresh?", cache_control="no-cache")
        assert (h1["x-cache"], h2["x-cache"], h2["x-cache-reason"]) == ("miss", "bypass", "no-cache")
        assert new != old  # the backend answered again: a numbered, different answer
        served, h3 = ask(url, "What is a refresh?")
        assert h3["x-cache"] == "exact-hit" and served == new
        key = key_of(db, entry_of(db, h3))
        [(entry_id, response)] = live_rows(db)[key]
        assert entry_id == entry_of(db, h3) and new in response
        newer, _ = ask(url, "What is a refresh?", cache_control="no-cache")  # and again: still one
        assert len(live_rows(db)[key]) == 1 and ask(url, "What is a refresh?")[0] == newer != new


def test_flagging_the_answer_of_a_key_takes_the_key_out_of_service(backend, tmp_path) -> None:
    """Before, each refresh added a copy, and flagging the newest brought the older one back."""
    with gateway(settings_for(tmp_path, [backend[0]])) as url:
        ask(url, "Is this answer good?")
        ask(url, "Is this answer good?", cache_control="no-cache")
        _, hit = ask(url, "Is this answer good?")
        assert hit["x-cache"] == "exact-hit"
        r = flagged_by_tenant(url, hit["x-request-id"])
        assert r.status_code == 200 and "never served again" in r.json()["action"], r.text
        _, after = ask(url, "Is this answer good?")
        assert (after["x-cache"], after["x-cache-reason"]) != ("exact-hit", "exact")
        assert after["x-cache"] == "miss"


def duplicate(url: str, entry_id: int, word: str, texts: list[str]) -> list[int]:
    """Copies of one entry, ``word`` in its answer replaced by each text (as a database from before the
    unique index holds them); their ids. Nothing but the gateway may open a Store on it afterwards:
    opening one cleans the copies."""
    store = Store(url)
    try:
        with store.engine.begin() as conn:
            conn.exec_driver_sql(f"DROP INDEX {LIVE_KEY_INDEX}")
            conn.exec_driver_sql("UPDATE alembic_version SET version_num = '0007'")  # the revision before it
        with store.session.begin() as s:
            original = s.get(CacheEntry, entry_id)
            assert original is not None
            columns = [c.key for c in CacheEntry.__table__.columns if c.key != "id"]
            copies = []
            for text in texts:
                fields: dict[str, Any] = {c: getattr(original, c) for c in columns}
                fields["response"] = fields["response"].replace(word, text)
                copies.append(CacheEntry(**fields))
            s.add_all(copies)
            s.flush()
            return [c.id for c in copies]
    finally:
        store.close()


def test_an_old_database_with_copies_of_a_key_keeps_only_the_newest_at_start(backend, tmp_path) -> None:
    db = f"sqlite:///{tmp_path / 'cachegw.db'}"
    with gateway(settings_for(tmp_path, [backend[0]])) as url:
        text, _ = ask(url, "Which copy is live?")
        _, h = ask(url, "Which copy is live?")
        entry_id = entry_of(db, h)
    first_word = text.split()[0]
    key = key_of(db, entry_id)
    copies = duplicate(db, entry_id, first_word, [f"{first_word}-copy-one", f"{first_word}-copy-two"])
    with sqlite3.connect(tmp_path / "cachegw.db") as conn:  # three live rows before the start
        assert conn.execute("SELECT count(*) FROM cache_entries WHERE bad = 0").fetchone()[0] == 3
    with gateway(settings_for(tmp_path, [backend[0]])) as url:
        assert [i for i, _ in live_rows(db)[key]] == [copies[-1]]
        served, h = ask(url, "Which copy is live?")
        assert h["x-cache"] == "exact-hit" and entry_of(db, h) == copies[-1]
        assert f"{first_word}-copy-two" in served


def test_the_store_keeps_one_live_entry_when_writers_race_for_a_key(shared_url) -> None:  # noqa: F811
    """Eight writers at once, on two stores (as two replicas), one key, three rounds: every commit
    lands, one row stays live, and each replaced row is logged for the replicas."""
    stores = [Store(shared_url), Store(shared_url)]
    entries = [sql_stores(store).entries for store in stores]
    errors: list[Exception] = []

    def put(i: int, barrier: threading.Barrier) -> None:
        now = time.time()
        entry = CacheEntry(tenant="t", model="m", endpoint="chat", scope="", exact_key="k", query_text="q",
                           response=f"answer {i}", finish_reason="stop", size_bytes=8, created_at=now,
                           expires_at=now + 60)  # fmt: skip
        barrier.wait()
        try:
            entries[i % 2].put_entry(entry, {f"reply-{i % 3}": "same text"})
        except Exception as exc:  # noqa: BLE001 - the test reports any
            errors.append(exc)

    for _ in range(3):
        barrier = threading.Barrier(8)
        threads = [threading.Thread(target=put, args=(i, barrier)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors[0]
    assert len(live_rows(shared_url)["k"]) == 1
    with stores[0].session() as s:
        assert s.scalar(select(func.count(ChangeRow.id)).where(ChangeRow.kind == "delete")) == 23
    for store in stores:
        store.close()


def test_the_live_key_index_exists_and_an_older_database_is_cleaned(shared_url) -> None:  # noqa: F811
    from sqlalchemy import inspect

    store = Store(shared_url)
    names = {i["name"]: i for i in inspect(store.engine).get_indexes("cache_entries")}
    assert names[LIVE_KEY_INDEX]["unique"]
    now = time.time()
    rows = [
        dict(exact_key=key, bad=bad, response=f"{key}-{n}")
        for key, bad, n in [
            ("a", False, 1),
            ("a", False, 2),
            ("a", True, 3),
            ("a", False, 4),
            ("b", False, 1),
        ]
    ]
    with store.engine.begin() as conn:
        conn.exec_driver_sql(f"DROP INDEX {LIVE_KEY_INDEX}")
        conn.exec_driver_sql("UPDATE alembic_version SET version_num = '0007'")  # the revision before it
    with store.session.begin() as s:
        s.add_all(
            CacheEntry(
                tenant="t",
                model="m",
                endpoint="chat",
                scope="",
                query_text="q",
                finish_reason="stop",
                size_bytes=1,
                created_at=now,
                expires_at=now + 60,
                **row,
            )  # fmt: skip
            for row in rows
        )
    store.close()
    live = live_rows(shared_url)  # reopening cleans
    assert [r for _, r in live["a"]] == ["a-4"] and [r for _, r in live["b"]] == ["b-1"]
    store = Store(shared_url)
    with store.session() as s:  # the flagged copy stays, as the record of its feedback
        assert s.scalar(select(func.count()).where(CacheEntry.bad.is_(True))) == 1
    store.close()


def test_a_replica_stops_serving_an_answer_another_replaced(backend, tmp_path, shared_url) -> None:  # noqa: F811
    a_settings = on_database(tmp_path / "a", backend[0], shared_url, sync_interval_s=0.2)
    b_settings = on_database(tmp_path / "b", backend[0], shared_url, sync_interval_s=0.2)
    with gateway(a_settings) as a, gateway(b_settings) as b:
        old, _ = ask(a, "Which replica answered?")
        eventually(lambda: ask(b, "Which replica answered?")[1]["x-cache"] == "exact-hit")
        assert ask(b, "Which replica answered?")[0] == old  # B holds the entry in memory now
        new, h = ask(a, "Which replica answered?", cache_control="no-cache")
        assert new != old and h["x-cache"] == "bypass"
        eventually(lambda: ask(b, "Which replica answered?")[0] == new)
        served, h = ask(b, "Which replica answered?")
        assert h["x-cache"] == "exact-hit" and served == new
        [(live_id, _)] = live_rows(shared_url)[key_of(shared_url, entry_of(shared_url, h))]
        assert live_id == entry_of(shared_url, h)


async def test_inserts_of_one_key_take_turns_and_their_locks_are_dropped() -> None:
    import asyncio

    from cachegw.gateway.cache.locks import KeyedLocks

    locks, order = KeyedLocks(), []

    async def hold(key: str, tag: str) -> None:
        async with locks.hold(key):
            order.append(f"{tag}+")
            await asyncio.sleep(0)
            order.append(f"{tag}-")

    await asyncio.gather(hold("k", "a"), hold("k", "b"), hold("other", "c"))
    assert order.index("a-") < order.index("b+") and len(locks) == 0
