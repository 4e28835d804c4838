"""The gateway on a real PostgreSQL server, and several gateway replicas on one database.

PostgreSQL comes from tests/services.py (Debian's package, a throwaway cluster on a loopback port). The
replica tests run on SQLite too: two gateways sharing one database file is the same situation, minus the
network. Every gateway here talks to the real built-in backend.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from cachegw.gateway.config import Settings
from cachegw.gateway.offline.analyze_summary import build_summary
from cachegw.gateway.storage.request_log import read_database
from cachegw.gateway.storage.store import Store, sql_stores
from tests.test_admin import TOKEN, admin_settings, api
from tests.test_gateway import ask, backend_url, chat, gateway  # noqa: F401


def fresh_database(server_url: str) -> str:
    """A new, empty database on the server, so tests never see each other's entries."""
    import psycopg

    name = f"t_{uuid.uuid4().hex[:12]}"
    dsn = server_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return server_url.rsplit("/", 1)[0] + f"/{name}"


@pytest.fixture(params=["sqlite", "postgresql"])
def shared_url(request, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'shared.db'}"
    return fresh_database(request.getfixturevalue("postgres"))


def on_database(data_dir: Path, backend: str, url: str, **cache_over) -> Settings:
    s = admin_settings(data_dir, backend, **cache_over)
    return s.model_copy(update={"gateway": s.gateway.model_copy(update={"database_url": url})})


def health(url: str) -> dict:
    """The admin view of /health (counts need the admin token)."""
    return httpx.get(f"{url}/health", headers={"authorization": f"Bearer {TOKEN}"}, timeout=30).json()


def eventually(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_the_gateway_runs_on_postgresql(backend_url, tmp_path, postgres):  # noqa: F811
    """Entries, the exact and semantic tiers, a restart that rebuilds the index from PostgreSQL alone,
    and the request log read back by `cachegw analyze`."""
    url_db = fresh_database(postgres)
    s = on_database(tmp_path / "first", backend_url, url_db)
    with gateway(s) as url:
        text, h, _ = chat(url, ask("How do I bake bread at home?"))
        assert h["x-cache"] == "miss"
        assert chat(url, ask("How do I bake bread at home?"))[1]["x-cache"] == "exact-hit"
        again, h, _ = chat(url, ask("How can I bake bread at home?"))
        assert h["x-cache"] == "semantic-hit" and again == text
    # another data dir: no index snapshot to read, so the index comes from PostgreSQL
    with gateway(on_database(tmp_path / "second", backend_url, url_db)) as url:
        assert health(url)["index_entries"] == 1
        again, h, _ = chat(url, ask("how can i bake bread at home"))
        assert h["x-cache"] == "semantic-hit" and again == text
    overall = build_summary(read_database(url_db, None, None), s)["overall"]
    assert (overall["requests"], overall["misses"], overall["exact_hits"], overall["semantic_hits"]) == (
        4,
        1,
        1,
        2,
    )


def test_an_older_postgresql_database_gets_the_new_columns(postgres):
    """A database made by an older cachegw (before Alembic): missing nullable columns and their indexes
    are added (tests/test_migrations.py upgrades every shipped schema)."""
    import psycopg

    url_db = fresh_database(postgres)
    Store(url_db).close()
    dsn = url_db.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP TABLE alembic_version")
        conn.execute("ALTER TABLE cache_entries DROP COLUMN updated_at")
        conn.execute("ALTER TABLE requests DROP COLUMN backend")
    Store(url_db).close()
    with psycopg.connect(dsn) as conn:
        cols = {r[0] for r in conn.execute("SELECT column_name FROM information_schema.columns")}
        indexes = {r[0] for r in conn.execute("SELECT indexname FROM pg_indexes")}
    assert {"updated_at", "backend"} <= cols and "ix_cache_entries_updated_at" in indexes


def test_replicas_share_entries_deletions_and_flags(backend_url, tmp_path, shared_url):  # noqa: F811
    """What one replica stores, the other answers; what one deletes or flags, the other stops serving,
    even an entry it holds in memory from its own last hit."""
    a_settings = on_database(tmp_path / "a", backend_url, shared_url, sync_interval_s=0.2)
    b_settings = on_database(tmp_path / "b", backend_url, shared_url, sync_interval_s=0.2)
    with gateway(a_settings) as a, gateway(b_settings) as b:
        text, h, _ = chat(a, ask("How do I renew my passport?"))
        assert h["x-cache"] == "miss"
        eventually(lambda: health(b)["index_entries"] == 1)
        assert health(b)["cache_entries"] == 1
        metrics = httpx.get(f"{b}/metrics", timeout=30).text
        assert "cachegw_gateway_index_entries 1.0" in metrics
        [age] = [
            float(ln.split()[1]) for ln in metrics.splitlines() if ln.startswith("cachegw_gateway_sync_age")
        ]
        assert 0 <= age < 5
        again, h, _ = chat(b, ask("How can I renew my passport?"))
        assert h["x-cache"] == "semantic-hit" and again == text
        entry = h["x-cache-entry"]  # the admin API takes the opaque id
        # deleted through A: B, which just served it, drops it from its index and memory
        assert api(a, "DELETE", f"/entries/{entry}").status_code == 200
        eventually(lambda: health(b)["index_entries"] == 0)
        _, h, _ = chat(b, ask("How can I renew my passport?"))
        assert h["x-cache"] == "miss"  # and B stores this answer itself
        own = int(api(b, "GET", "/entries").json()["data"][0]["id"])
        eventually(lambda: health(a)["index_entries"] == 1)
        assert chat(b, ask("How can I renew my passport?"))[1]["x-cache"] == "exact-hit"
        # flagged bad through A: B stops serving its own entry, exact repeats included
        r = api(a, "POST", "/feedback", json={"entry_id": own, "verdict": "bad"})
        assert r.status_code == 200, r.text
        eventually(lambda: health(b)["index_entries"] == 0)
        assert chat(b, ask("How can I renew my passport?"))[1]["x-cache"] == "miss"


async def test_sync_moves_the_counts_and_the_index_with_other_replicas(tmp_path):
    """Two ResponseCaches on one SQLite file, no HTTP: counts, index and exact keys follow the other's
    inserts, flags and deletions, and a replica's own changes are not counted twice."""
    import numpy as np

    from cachegw.embeddings.index import ScopedIndex
    from cachegw.gateway.cache.response_cache import ResponseCache
    from cachegw.gateway.config import load_settings
    from cachegw.gateway.storage.tables import CacheEntry

    url = f"sqlite:///{tmp_path / 'shared.db'}"
    config = load_settings(None).cache
    db_here, db_there = Store(url), Store(url)
    here, there = sql_stores(db_here), sql_stores(db_there)
    cache = ResponseCache(config, here, ScopedIndex(dim=4, background=False), None, None)
    cache.rebuild_index(progress=False)

    def entry(i: int) -> CacheEntry:
        now = time.time()
        vec = np.eye(4, dtype=np.float32)[i % 4].tobytes()
        return CacheEntry(tenant="t", model="m", endpoint="chat", scope="s", exact_key=f"k{i}",
                          query_text=f"q{i}", embedding=vec, response="{}" * (i + 1), finish_reason="stop",
                          size_bytes=10 * (i + 1), created_at=now, expires_at=now + 600)  # fmt: skip

    ids = [there.entries.add_entry(entry(i)) for i in range(3)]
    assert await cache.sync() == 3
    assert (cache.entries, cache.bytes, len(cache.index)) == (3, 60, 3)
    assert await cache.sync() == 0  # the log has nothing new
    there.entries.mark_bad(ids[0])
    there.entries.delete_entries([ids[1]])
    assert await cache.sync() == 2
    # the flagged entry is still a row (counted), the deleted one is gone
    assert (cache.entries, cache.bytes, len(cache.index)) == (2, 40, 1) == (*here.entries.totals(), 1)
    assert ids[2] in cache.index and ids[0] not in cache.exact
    await cache.delete([ids[2]])  # this replica's own deletion: counted once
    assert await cache.sync() == 0
    assert (cache.entries, cache.bytes, len(cache.index)) == (1, 10, 0) == (*here.entries.totals(), 0)
    db_here.close()
    db_there.close()


@pytest.mark.parametrize(
    ("database_url", "message"),
    [
        # nothing listens on port 1: the server refuses
        ("postgresql+psycopg://cachegw:s3cret@127.0.0.1:1/cachegw", "connection to server at"),
        ("mysql+pymysql://u:s3cret@127.0.0.1/x", "No module named 'pymysql' (install the driver"),
        ("not a url", "Could not parse"),
    ],
    ids=["refused", "missing-driver", "not-a-url"],
)
def test_a_database_that_cannot_be_opened_stops_the_start_with_one_line(
    tmp_path, capsys, database_url, message
):
    from cachegw.gateway.cli import main

    config = tmp_path / "c.toml"
    config.write_text(f'[gateway]\ndatabase_url = "{database_url}"\nbackends = ["http://127.0.0.1:9/v1"]\n')
    assert main(["serve", "--config", str(config), "--data-dir", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("cachegw: error: cannot open the database ") and message in err
    assert "s3cret" not in err  # the password is never printed
