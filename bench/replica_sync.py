"""What keeping a replica's in-memory views in step with a shared database costs, against a restart.

Several gateways on one database each hold their own vector index and exact-key map. ``ResponseCache.sync``
(every ``[cache] sync_interval_s``) applies what the others stored, flagged or deleted. The peer is what a
replica had before: only a restart (``rebuild_index``, reading every row) brought others' entries in.

1. the database is filled with ``--entries`` rows (random unit vectors over 100 scopes: sync and rebuild
   costs do not depend on what the vectors mean), created over the past day, so outside the sync window
   (on PostgreSQL then ``ANALYZE``, as autovacuum soon does: without statistics the planner scans the
   table instead of using the ``created_at`` / ``updated_at`` indexes, 180 ms instead of 0.05 ms);
2. replica B starts: ``rebuild_index``, timed;
3. idle syncs (nothing changed), timed;
4. another replica stores ``--changes`` entries, B syncs once; then it deletes them, B syncs once;
   both timed and checked (B's index grows by exactly that many, then shrinks back).

    .venv/bin/python -m bench.replica_sync [--db URL] [--entries 200000] [--changes 100]

``--db`` takes any SQLAlchemy URL of an empty database (default: a SQLite file in a temp dir), e.g.
``postgresql+psycopg://user@127.0.0.1:5432/bench``.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import numpy as np
from sqlalchemy import insert, text

from bench.common import pct, save, say
from cachegw.embeddings.index import ScopedIndex
from cachegw.gateway.cache.response_cache import ResponseCache
from cachegw.gateway.config import load_settings
from cachegw.gateway.storage.store import Store, sql_stores
from cachegw.gateway.storage.tables import CacheEntry

DIM = 384
SCOPES = 100


def rows(rng: np.random.Generator, start: int, n: int, created: float) -> list[dict]:
    vecs = rng.standard_normal((n, DIM)).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    body = '{"choices": [{"message": {"role": "assistant", "content": "an answer"}}]}'
    return [
        {
            "tenant": "t",
            "model": "m",
            "endpoint": "chat",
            "scope": f"scope-{(start + j) % SCOPES}",
            "exact_key": f"key-{start + j}",
            "query_text": f"question {start + j}",
            "embedding": vecs[j].tobytes(),
            "response": body,
            "finish_reason": "stop",
            "size_bytes": len(body),
            "created_at": created,
            "expires_at": time.time() + 86400 * 7,
        }
        for j in range(n)
    ]


def fill(store: Store, n: int, rng: np.random.Generator) -> float:
    t0 = time.perf_counter()
    day_ago = time.time() - 86400
    for start in range(0, n, 10_000):
        with store.session.begin() as s:
            s.execute(insert(CacheEntry), rows(rng, start, min(10_000, n - start), day_ago))
        say(f"  filled {min(start + 10_000, n):,}/{n:,}")
    return time.perf_counter() - t0


async def measure(url: str, n: int, changes: int) -> dict:
    rng = np.random.default_rng(0)
    store = Store(url)
    say(f"filling {url.split('://')[0]} with {n:,} entries")
    fill_s = fill(store, n, rng)
    if store.engine.dialect.name == "postgresql":  # what autovacuum does soon after a bulk load
        with store.engine.connect() as conn:
            conn.execute(text("ANALYZE"))
            conn.commit()
    config = load_settings(None).cache
    b = ResponseCache(config, sql_stores(store), ScopedIndex(dim=DIM, background=False), None, None)
    t0 = time.perf_counter()
    indexed = b.rebuild_index(progress=True)
    rebuild_s = time.perf_counter() - t0
    assert indexed == n, (indexed, n)
    idle = []
    for _ in range(30):
        t0 = time.perf_counter()
        await b.sync()
        idle.append((time.perf_counter() - t0) * 1e3)
    # another replica (a second Store on the same database) stores, then deletes
    other = Store(url)
    other_entries = sql_stores(other).entries
    ids = [other_entries.add_entry(CacheEntry(**r)) for r in rows(rng, n, changes, time.time())]
    t0 = time.perf_counter()
    applied = await b.sync()
    sync_new_ms = (time.perf_counter() - t0) * 1e3
    assert applied == changes and len(b.index) == n + changes, (applied, len(b.index))
    other_entries.delete_entries(ids)
    t0 = time.perf_counter()
    applied = await b.sync()
    sync_deleted_ms = (time.perf_counter() - t0) * 1e3
    assert applied == changes and len(b.index) == n, (applied, len(b.index))
    other.close()
    store.close()
    return {
        "database": url.split("://")[0],
        "entries": n,
        "changes": changes,
        "fill_s": round(fill_s, 1),
        "restart_rebuild_s": round(rebuild_s, 2),
        "idle_sync_ms_p50": round(pct(idle, 50), 2),
        "idle_sync_ms_p99": round(pct(idle, 99), 2),
        "sync_new_entries_ms": round(sync_new_ms, 1),
        "sync_deleted_entries_ms": round(sync_deleted_ms, 1),
        "rebuild_over_sync_new": round(rebuild_s * 1e3 / sync_new_ms, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--db", help="SQLAlchemy URL of an empty database (default: SQLite in a temp dir)")
    ap.add_argument("--entries", type=int, default=200_000)
    ap.add_argument("--changes", type=int, default=100)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        url = args.db or f"sqlite:///{Path(tmp) / 'bench.db'}"
        result = asyncio.run(measure(url, args.entries, args.changes))
    say(str(result))
    name = f"replica_sync_{result['database'].split('+')[0]}_{result['entries']}"
    db = f" --db {result['database']}://..." if args.db else ""
    save(name, {"command": f"python -m bench.replica_sync{db} --entries {args.entries}", **result})


if __name__ == "__main__":
    main()
