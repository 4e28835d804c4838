"""What one live entry per exact key costs: storing as a replace, and cleaning an old database at start.

1. the database is filled with ``--entries`` rows (bench/replica_sync.py's rows) with the unique index
   dropped, and every ``--every``-th key given two extra copies, as a database written before the index;
2. ``Store(url)`` opens it: the copies are retired (the newest kept) and the index built, timed and
   checked (no key left with two live rows);
3. ``Store(url)`` opens it again: the start-up cost once the index exists;
4. ``--puts`` stores of new keys (nothing to replace) and of existing keys (one entry replaced), each
   ``SqlEntries.put_entry`` timed, against a plain insert in one transaction (what ``add_entry`` was).

    .venv/bin/python -m bench.live_key [--db URL] [--entries 200000] [--every 10] [--puts 300]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
from sqlalchemy import func, insert, select

from bench.common import pct, save, say
from bench.replica_sync import rows
from cachegw.gateway.storage.store import Store, sql_stores
from cachegw.gateway.storage.tables import LIVE_KEY_INDEX, CacheEntry


def fill(url: str, n: int, every: int) -> int:
    """n rows plus two copies of every ``every``-th key; the number of copies."""
    store = Store(url)
    with store.engine.begin() as conn:
        conn.exec_driver_sql(f"DROP INDEX {LIVE_KEY_INDEX}")
        conn.exec_driver_sql("UPDATE alembic_version SET version_num = '0007'")  # the revision before it
    rng = np.random.default_rng(0)
    day_ago = time.time() - 86400
    copies = 0
    for start in range(0, n, 10_000):
        batch = rows(rng, start, min(10_000, n - start), day_ago)
        extra = [dict(r) for r in batch[::every] for _ in range(2)]
        copies += len(extra)
        with store.session.begin() as s:
            s.execute(insert(CacheEntry), batch + extra)
    store.close()
    return copies


def live_copies(store: Store) -> int:
    """Live rows beyond the first of their key (0 when the rule holds)."""
    with store.session() as s:
        keys = select(CacheEntry.exact_key).where(CacheEntry.bad.is_(False)).distinct().subquery()
        live = s.scalar(select(func.count()).where(CacheEntry.bad.is_(False))) or 0
        return live - (s.scalar(select(func.count()).select_from(keys)) or 0)


def entry(key: str) -> CacheEntry:
    now = time.time()
    return CacheEntry(tenant="t", model="m", endpoint="chat", scope="s", exact_key=key, query_text="q",
                      response='{"choices": []}', finish_reason="stop", size_bytes=15, created_at=now,
                      expires_at=now + 600)  # fmt: skip


def timed(fn, keys: list[str]) -> list[float]:
    out = []
    for key in keys:
        t0 = time.perf_counter()
        fn(entry(key))
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def measure(url: str, n: int, every: int, puts: int) -> dict:
    say(f"filling {url.split('://')[0]} with {n:,} entries")
    copies = fill(url, n, every)
    t0 = time.perf_counter()
    store = Store(url)
    clean_s = time.perf_counter() - t0
    left = live_copies(store)
    store.close()
    t0 = time.perf_counter()
    store = Store(url)
    open_s = time.perf_counter() - t0

    def plain(e: CacheEntry) -> None:
        with store.session.begin() as s:
            s.add(e)

    entries = sql_stores(store).entries
    new = timed(entries.put_entry, [f"new-{i}" for i in range(puts)])
    replace = timed(entries.put_entry, [f"key-{i}" for i in range(puts)])
    insert_only = timed(plain, [f"plain-{i}" for i in range(puts)])
    left_after = live_copies(store)
    store.close()
    return {
        "database": url.split("://")[0],
        "entries": n,
        "copies": copies,
        "start_cleaning_s": round(clean_s, 2),
        "live_copies_after_start": left,
        "start_clean_db_s": round(open_s, 3),
        "put_new_ms_p50": round(pct(new, 50), 2),
        "put_new_ms_p99": round(pct(new, 99), 2),
        "put_replace_ms_p50": round(pct(replace, 50), 2),
        "put_replace_ms_p99": round(pct(replace, 99), 2),
        "plain_insert_ms_p50": round(pct(insert_only, 50), 2),
        "plain_insert_ms_p99": round(pct(insert_only, 99), 2),
        "live_copies_after_puts": left_after,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--db", help="SQLAlchemy URL of an empty database (default: SQLite in a temp dir)")
    ap.add_argument("--entries", type=int, default=200_000)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--puts", type=int, default=300)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        url = args.db or f"sqlite:///{Path(tmp) / 'bench.db'}"
        result = measure(url, args.entries, args.every, args.puts)
    say(str(result))
    name = f"live_key_{result['database'].split('+')[0]}_{result['entries']}"
    db = f" --db {result['database']}://..." if args.db else ""
    save(name, {"command": f"python -m bench.live_key{db} --entries {args.entries}", **result})


if __name__ == "__main__":
    main()
