"""Restart time of the vector index: HNSW read back from its snapshot against rebuilt from the rows.

One scope of n real MiniLM embeddings (the corpus of bench/faiss_lookup.py, embeddings cached under /tmp):
1. cold start, no snapshot: ``ScopedIndex.rebuild`` builds HNSW from the rows (what every restart cost
   before snapshots), then writes the snapshot;
2. restart with an up-to-date snapshot (an orderly shutdown saved it);
3. restart with a stale snapshot: 1% of the entries deleted and 1% new ones written after it (a kill -9
   before the shutdown save), reconciled against the rows;
each checked for paraphrase recall@1 against exact search over the live rows. The rows come from memory:
reading them from the database is the same in every case and is not included.

    .venv/bin/python -m bench.index_restart [--n 1000000]
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time
from pathlib import Path

import faiss
import numpy as np

from bench.common import save, say
from bench.faiss_lookup import corpus, embed_cached, pick_queries
from cachegw.embeddings import snapshot
from cachegw.embeddings.index import HNSW_THRESHOLD, ScopedIndex

SCOPE = "bench"


def start(directory: Path | None, ids: np.ndarray, xb: np.ndarray) -> tuple[ScopedIndex, float]:
    """A fresh ScopedIndex loaded the way the gateway starts; seconds it took."""
    index = ScopedIndex(dim=xb.shape[1], background=False, snapshot_dir=directory)
    t0 = time.perf_counter()
    rows = ((SCOPE, int(i), xb[j]) for j, i in enumerate(ids))
    index.rebuild(rows, total=len(ids), progress=True)
    return index, time.perf_counter() - t0


def recall(index: ScopedIndex, ids: np.ndarray, xb: np.ndarray, xq: np.ndarray) -> float:
    """Share of queries whose top hit is the exact top hit over the live rows (ties count)."""
    flat = faiss.IndexFlatIP(xb.shape[1])
    flat.add(xb)
    gt_score, gt_pos = flat.search(xq, 1)
    got = index.search_batch([SCOPE] * len(xq), xq, k=1)
    ok = [
        bool(r) and (r[0][0] == ids[p] or r[0][1] >= s - 1e-5)
        for r, p, s in zip(got, gt_pos[:, 0], gt_score[:, 0], strict=True)
    ]
    return round(float(np.mean(ok)), 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--queries", type=int, default=2000)
    args = ap.parse_args()
    if args.n < HNSW_THRESHOLD:
        ap.error(f"--n must be at least {HNSW_THRESHOLD} (the HNSW threshold), got {args.n}")

    say("[1/4] corpus and embeddings (cached under /tmp)")
    # the same corpus and queries as bench/faiss_lookup.py's defaults, so its cached embeddings are reused
    queries = pick_queries(args.queries, args.queries // 2)
    texts, _, _ = corpus(args.n, queries, first=min(10_000, args.n))
    xb = embed_cached(texts, "corpus")
    xq = embed_cached(queries["para"] + queries["neg"], "queries")[: len(queries["para"])]
    ids = np.arange(args.n, dtype=np.int64)
    drift = args.n // 100
    # the snapshot holds all but the last 1%; the stale restart's rows drop the first 1% and add the last
    base_ids, base_xb = ids[: args.n - drift], xb[: args.n - drift]

    with tempfile.TemporaryDirectory(prefix="cachegw-snap-") as tmp:
        directory = Path(tmp)
        say("[2/4] cold start: HNSW built from the rows (then its snapshot written)")
        built, build_s = start(directory, base_ids, base_xb)
        t0 = time.perf_counter()
        path = snapshot.save(directory, SCOPE, built._scopes[SCOPE].index)  # timed alone, same call
        save_s = time.perf_counter() - t0
        size = path.stat().st_size
        recall_built = recall(built, base_ids, base_xb, xq)
        del built

        say("[3/4] restart with an up-to-date snapshot")
        restored, restore_s = start(directory, base_ids, base_xb)
        assert restored.scope_kind(SCOPE) == "hnsw" and restored.stats()["tombstones"] == 0
        recall_restored = recall(restored, base_ids, base_xb, xq)
        del restored

        say("[4/4] restart with a stale snapshot: 1% deleted and 1% added since")
        live_ids, live_xb = ids[drift:], xb[drift:]
        stale, stale_s = start(directory, live_ids, live_xb)
        st = stale.stats()
        assert st["tombstones"] == drift and st["entries"] == len(live_ids)
        recall_stale = recall(stale, live_ids, live_xb, xq)

    rss_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    result = {
        "n": args.n,
        "rows_from": "memory (the database read is the same in every case and not included)",
        "build_from_rows_s": round(build_s, 1),
        "snapshot_write_s": round(save_s, 1),
        "snapshot_bytes": size,
        "snapshot_bytes_per_entry": round(size / len(base_ids), 1),
        "restart_from_snapshot_s": round(restore_s, 1),
        "restart_from_stale_snapshot_s": round(stale_s, 1),
        "stale": {"deleted": drift, "added": drift},
        "speedup_up_to_date": round(build_s / restore_s, 1),
        "speedup_stale": round(build_s / stale_s, 1),
        "paraphrase_recall_at_1": {"built": recall_built, "restored": recall_restored, "stale": recall_stale},
        "peak_rss_gb": round(rss_gb, 2),
    }
    say(str(result))
    save("index_restart", result)


if __name__ == "__main__":
    main()
