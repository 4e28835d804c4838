"""The shared pgvector index against the FAISS store: lookup p50/p99 and recall@1 at --n entries in ONE scope.

Both stores at the product's defaults from config.toml ([index] hnsw_m, ef_construction, ef_search; FAISS
also hnsw_threshold), built the way the gateway builds them: pgvector through ``PgVectorIndex`` and the
trigger that indexes each entry as it is inserted into ``cache_entries`` (batches of --batch rows, an
HNSW index that grows with them; with --bulk-build the index is dropped while inserting and built once
after, pgvector's bulk build, much faster past 10k entries on 2 cores), FAISS through
``ScopedIndex.rebuild``. Lookups are timed one query per call, the two stores taking turns query by query
(which goes first alternates), so load drift on this shared machine hits both alike. Recall@1 is against
exact search (a tie counts as found).

Corpus and queries are bench/faiss_lookup.py's (real MiniLM embeddings, cached per chunk under /tmp): the
first --real texts are real; past them, a labelled synthetic tier (a random real vector plus Gaussian
noise of norm ~--noise, renormalized) fills up to --n. Queries are held-out real QQP paraphrases and hard
non-duplicates. Also measured: what the trigger costs a write (the same rows inserted into a database
without the pgvector schema), the database's size and the FAISS index's bytes.

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.shared_index --n 100000 --bulk-build
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
from sqlalchemy import Engine, insert, text
from tqdm import tqdm

from bench.common import RESULTS, pct, save, say
from bench.faiss_lookup import Eval, corpus, embed_cached, pick_queries
from bench.pg_server import SETTINGS, new_database, pg_server
from cachegw.embeddings.index import ScopedIndex
from cachegw.gateway.config import load_settings
from cachegw.gateway.storage.pgvector_index import PgVectorIndex
from cachegw.gateway.storage.store import Store
from cachegw.gateway.storage.tables import CacheEntry

SCOPE = "bench"


def synthetic(real: np.ndarray, n: int, noise: float, seed: int = 0) -> np.ndarray:
    """n vectors near real ones: a random real row plus noise of norm ~``noise``, renormalized."""
    rng = np.random.default_rng(seed)
    out = real[rng.integers(0, len(real), n)] + rng.standard_normal((n, real.shape[1]), np.float32) * (
        noise / np.sqrt(real.shape[1])
    )
    return (out / np.linalg.norm(out, axis=1, keepdims=True)).astype(np.float32)


def entry_rows(xb: np.ndarray, start: int, stop: int) -> list[dict]:
    """cache_entries rows for positions [start, stop), id = position + 1 (so results map back)."""
    now = time.time()
    return [
        {
            "id": i + 1,
            "tenant": "t",
            "model": "m",
            "endpoint": "chat",
            "scope": SCOPE,
            "exact_key": f"k{i}",
            "query_text": f"q{i}",
            "embedding": xb[i].tobytes(),
            "response": "{}",
            "finish_reason": "stop",
            "size_bytes": 2,
            "created_at": now,
            "expires_at": now + 86400 * 365,
        }
        for i in range(start, stop)
    ]


def insert_all(engine: Engine, xb: np.ndarray, batch: int, desc: str) -> list[float]:
    """Insert every row, ``batch`` per transaction; seconds per batch."""
    secs = []
    for start in tqdm(range(0, len(xb), batch), desc=desc, file=sys.stderr, unit="batch"):
        rows = entry_rows(xb, start, min(len(xb), start + batch))
        t0 = time.perf_counter()
        with engine.begin() as conn:
            conn.execute(insert(CacheEntry), rows)
        secs.append(time.perf_counter() - t0)
    with engine.begin() as conn:
        conn.execute(text("SELECT setval(pg_get_serial_sequence('cache_entries', 'id'), :n)"), {"n": len(xb)})
        conn.execute(text("ANALYZE"))
    return secs


def sizes(engine: Engine) -> dict[str, int]:
    query = text(
        "SELECT pg_total_relation_size('entry_vectors'), pg_relation_size('ix_entry_vectors_hnsw'), "
        "pg_total_relation_size('cache_entries'), pg_database_size(current_database())"
    )
    with engine.connect() as conn:
        vectors, hnsw, entries, database = conn.execute(query).one()
    return {"entry_vectors_bytes": vectors, "hnsw_index_bytes": hnsw, "cache_entries_bytes": entries} | {
        "database_bytes": database
    }


def interleaved(
    pg: PgVectorIndex, fx: ScopedIndex, xq: np.ndarray, warmup: int = 20
) -> dict[str, tuple[list[float], np.ndarray, np.ndarray]]:
    """Per store: per-query ms, top-1 positions (-1: none found), top-1 cosines; query by query in turn."""
    stores = {"pgvector": pg.search, "faiss": fx.search}
    out: dict[str, tuple[list[float], np.ndarray, np.ndarray]] = {
        name: ([], np.full(len(xq), -1), np.full(len(xq), -2.0)) for name in stores
    }
    for q in xq[:warmup]:
        for search in stores.values():
            search(SCOPE, q)
    names = list(stores)
    for j, q in enumerate(tqdm(xq, desc="lookups", file=sys.stderr, unit="query")):
        for name in names if j % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            found = stores[name](SCOPE, q)
            out[name][0].append((time.perf_counter() - t0) * 1e3)
            if found:
                out[name][1][j], out[name][2][j] = found[0][0] - 1, found[0][1]
    return out


def score(ev: Eval, lat: list[float], ids: np.ndarray, sims: np.ndarray) -> dict[str, float | None]:
    hit = (ids == ev.gt_ids) | (sims >= ev.gt_scores - 1e-5)
    out: dict[str, float | None] = {"p50_ms": round(pct(lat, 50), 3), "p99_ms": round(pct(lat, 99), 3)}
    for name, mask in ev.masks.items():
        out[f"recall_{name}"] = round(float(hit[mask].mean()), 4) if mask.any() else None
    return out


def trigger_cost(server: str, xb: np.ndarray, batch: int, rows: int = 5000) -> dict[str, float]:
    """ms per inserted entry into a database without the pgvector schema (what the FAISS store needs)
    and into one with it (trigger: decode the embedding, insert into a growing HNSW index), same rows."""
    out: dict[str, float] = {"rows": rows}
    for name, schema in (("without_ms_per_entry", False), ("with_ms_per_entry", True)):
        store = Store(new_database(server))
        if schema:
            ix = load_settings().index
            PgVectorIndex(store.engine, xb.shape[1], ix.ef_search, ix.hnsw_m, ix.ef_construction)
        secs = insert_all(store.engine, xb[:rows], batch, f"insert, {name}")
        out[name] = round(sum(secs) * 1e3 / rows, 3)
        store.close()
    return out


def bulk_build(engine: Engine, m: int, ef_construction: int) -> float:
    """Build the HNSW index over the vectors already in the table (pgvector's bulk build); seconds."""
    t0 = time.perf_counter()
    with engine.begin() as conn:
        conn.execute(
            text(
                "CREATE INDEX ix_entry_vectors_hnsw ON entry_vectors USING hnsw (embedding vector_ip_ops) "
                f"WITH (m = {m}, ef_construction = {ef_construction})"
            )
        )
        conn.execute(text("ANALYZE"))
    return round(time.perf_counter() - t0, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--real", type=int, default=100_000, help="real texts; the rest is the synthetic tier")
    ap.add_argument(
        "--noise", type=float, default=0.3, help="synthetic tier: noise norm before renormalizing"
    )
    ap.add_argument("--queries", type=int, default=2000, help="paraphrase queries (+ half as many negatives)")
    ap.add_argument("--batch", type=int, default=1000, help="entries per insert transaction")
    ap.add_argument(
        "--bulk-build",
        action="store_true",
        help="insert with the HNSW index dropped, then build it once (pgvector's bulk build; much faster)",
    )
    args = ap.parse_args()
    ix = load_settings().index

    say("[1/5] corpus, held-out queries and their embeddings (cached under /tmp)")
    queries = pick_queries(args.queries, args.queries // 2)
    texts, used, available = corpus(min(args.n, args.real), queries, first=10_000)
    xb = embed_cached(texts, "corpus")
    if args.n > len(xb):
        used["synthetic_real_plus_noise"] = args.n - len(xb)
        xb = np.concatenate([xb, synthetic(xb, args.n - len(xb), args.noise)])
    xq = embed_cached(queries["para"] + queries["neg"], "queries")
    ev = Eval(xb, xq, np.arange(len(xq)) < len(queries["para"]))

    with pg_server() as server:
        say(f"[2/5] pgvector: schema, then {args.n} entries inserted through the trigger")
        store = Store(new_database(server))
        pg = PgVectorIndex(store.engine, xb.shape[1], ix.ef_search, ix.hnsw_m, ix.ef_construction)
        if args.bulk_build:
            with store.engine.begin() as conn:
                conn.execute(text("DROP INDEX ix_entry_vectors_hnsw"))
        secs = insert_all(
            store.engine, xb, args.batch, "insert + trigger" + ("" if args.bulk_build else " + HNSW")
        )
        pg_info: dict[str, object] = {"bulk_build": args.bulk_build, "insert_s": round(sum(secs), 1)}
        pg_info["entries_per_s"] = round(args.n / sum(secs), 1)
        if args.bulk_build:
            pg_info["hnsw_build_s"] = bulk_build(store.engine, ix.hnsw_m, ix.ef_construction)
        pg_info |= sizes(store.engine)
        say(f"pgvector: {pg_info}")
        say("[3/5] FAISS: ScopedIndex.rebuild of the same scope")
        fx = ScopedIndex(
            xb.shape[1], ix.hnsw_threshold, ix.hnsw_m, ix.ef_construction, ix.ef_search, background=False
        )
        t0 = time.perf_counter()
        fx.rebuild(((SCOPE, i + 1, xb[i]) for i in range(len(xb))), total=len(xb), progress=True)
        fx_info = {"build_s": round(time.perf_counter() - t0, 1), "kind": fx.scope_kind(SCOPE), **fx.stats()}
        say(f"faiss: {fx_info}")
        say("[4/5] lookups, interleaved query by query")
        timed = interleaved(pg, fx, xq)
        results = {name: score(ev, *r) for name, r in timed.items()}
        say(f"lookups: {results}")
        say("[5/5] the trigger's cost per write")
        trigger = trigger_cost(server, xb, args.batch)
        store.close()

    save(
        f"shared_index_{args.n}",
        {
            "n": args.n,
            "scope": "one scope holds all n entries",
            "index_config": {"hnsw_m": ix.hnsw_m, "ef_construction": ix.ef_construction}
            | {
                "ef_search": ix.ef_search,
                "hnsw_threshold": ix.hnsw_threshold,
            },
            "postgres_settings": SETTINGS,
            "corpus": {"used": used, "available": available, "synthetic_noise": args.noise},
            "queries": {k: int(v.sum()) for k, v in ev.masks.items()},
            "lookups": results,
            "pgvector": pg_info,
            "faiss": fx_info,
            "trigger_cost": trigger,
            "load_avg_1m": round(os.getloadavg()[0], 2),
        },
    )
    plot()


def plot() -> None:
    """p50, p99 and recall@1 (paraphrases) per store at every n measured so far."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = sorted(
        (json.loads(p.read_text()) for p in RESULTS.glob("shared_index_*.json")), key=lambda r: r["n"]
    )
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    width = 0.38
    for k, (metric, label) in enumerate(
        [
            ("p50_ms", "p50 lookup (ms)"),
            ("p99_ms", "p99 lookup (ms)"),
            ("recall_para", "recall@1, paraphrases"),
        ]
    ):
        ax = axes[k]
        for s, store in enumerate(["faiss", "pgvector"]):
            xs = [i + (s - 0.5) * width for i in range(len(runs))]
            ax.bar(xs, [r["lookups"][store][metric] for r in runs], width, label=store)
        ax.set_xticks(range(len(runs)), [f"{r['n']:,}" for r in runs])
        ax.set_title(label)
        ax.set_xlabel("entries in the scope")
        if metric == "recall_para":
            ax.set_ylim(0.9, 1.0)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "shared_index.png", dpi=120)
    say(f"wrote {RESULTS / 'shared_index.png'}")


if __name__ == "__main__":
    main()
