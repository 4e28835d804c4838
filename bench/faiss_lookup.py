"""FAISS lookup latency and recall@1 at --n entries in ONE scope, on real MiniLM embeddings; plus the batcher.

Target at n = 1M: HNSW p50 <= 2 ms with recall@1 >= 0.99 against exact search on held-out paraphrase
queries (random vectors mislead: ../shared/notes/measured-facts.md). Corpus: de-duplicated real texts from
../shared/data in tiers, used in order until n is reached: (1) QQP questions, banking77 queries, sentences
of ShareGPT human turns, system prompts and ShareGPT assistant turns; (2) two and (3) three consecutive
sentences of one real message or prompt; (4) two random real sentences joined (synthetic, only if the real
tiers run out); the JSON counts each. Queries: held-out QQP question2 whose question1 is indexed, paraphrases
and hard non-duplicates reported apart. Embeddings are cached per 25k-text chunk by content hash under
/tmp/cachegw-bench-embeddings/: a 1M run reuses a 100k run's chunks, an interrupted run resumes.

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.faiss_lookup --n 100000 --ef-construction 40,80,160
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import hashlib
import json
import os
import random
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import faiss
import numpy as np
from tqdm import tqdm

from bench.common import SHARED_DATA, pct, save, say
from cachegw.embeddings.index import EF_CONSTRUCTION, EF_SEARCH, HNSW_M, HNSW_THRESHOLD, ScopedIndex

CACHE = Path("/tmp/cachegw-bench-embeddings")
CHUNK = 25_000
SPLIT = re.compile(r"(?<=[.!?])\s+|\n+")
Search = Callable[[np.ndarray], tuple[int, float]]


def clean(text: str) -> str:
    return " ".join(text.split())


def sentences(text: str) -> list[str]:
    """Sentences of 3+ words and at most 300 chars: the size of a cached prompt line, not a code dump."""
    out = (clean(s) for s in SPLIT.split(text) if s)
    return [s for s in out if len(s.split()) >= 3 and len(s) <= 300]


def rows(name: str) -> list[dict[str, str]]:
    path = SHARED_DATA / name
    if not path.exists():
        sys.exit(f"error: {path} not found; this benchmark reads its data from ../shared/data")
    csv.field_size_limit(1 << 30)
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def documents() -> Iterator[tuple[str, list[str]]]:
    """(source, sentences) per real message or prompt, in file order; a QQP/banking77 text is its own doc."""
    for r in rows("qqp_dev.csv"):
        yield "qqp", [clean(r["question1"])]
        yield "qqp", [clean(r["question2"])]
    for r in rows("banking77_train.csv"):
        yield "banking77", [clean(r["text"])]
    convs = [json.loads(line)["conversations"] for line in (SHARED_DATA / "sharegpt_dev.jsonl").open()]
    for conv in convs:
        yield from (("sharegpt_human", sentences(t["value"])) for t in conv if t["from"] == "human")
    for r in rows("system_prompts.csv"):
        yield "system_prompts", sentences(r["prompt"])
    for conv in convs:
        yield from (("sharegpt_gpt", sentences(t["value"])) for t in conv if t["from"] != "human")


def pick_queries(n_para: int, n_neg: int) -> dict[str, list[str]]:
    """Held-out QQP question2 texts and their question1 partners (which go into the corpus)."""
    pairs = [
        (clean(r["question1"]), clean(r["question2"]), r["is_duplicate"] == "1") for r in rows("qqp_dev.csv")
    ]
    random.Random(0).shuffle(pairs)
    out: dict[str, list[str]] = {"para": [], "para_partner": [], "neg": [], "neg_partner": []}
    held: set[str] = set()
    partners: set[str] = set()
    for q1, q2, dup in pairs:
        kind = "para" if dup else "neg"
        if len(out[kind]) >= (n_para if dup else n_neg) or q1 == q2 or len(q2.split()) < 3:
            continue
        if q2 in partners or q2 in held or q1 in held:
            continue
        out[kind].append(q2)
        out[f"{kind}_partner"].append(q1)
        held.add(q2)
        partners.add(q1)
    return out


def corpus(
    n: int, queries: dict[str, list[str]], first: int
) -> tuple[list[str], dict[str, int], dict[str, int]]:
    """The first n texts of one fixed order (independent of n, so embedding chunks are shared across runs).

    Returns the texts, how many came from each source/tier, and how many each tier has available.
    """
    origin = dict.fromkeys(queries["para_partner"] + queries["neg_partner"], "qqp_query_partners")
    partners, held = list(origin), set(queries["para"]) | set(queries["neg"])
    windows: dict[str, list[str]] = {"windows2": [], "windows3": []}
    singles: list[str] = []
    for source, sents in documents():
        for s in sents:
            if s not in origin and s not in held:
                origin[s] = source
                singles.append(s)
        for w in (2, 3):
            windows[f"windows{w}"].extend(" ".join(sents[i : i + w]) for i in range(len(sents) - w + 1))
    rng = random.Random(1)
    rng.shuffle(singles)
    cut = max(0, first - len(partners))
    head = partners + singles[:cut]
    rng.shuffle(head)  # query partners sit among the first `first` entries, so every measured size has them
    order = head + singles[cut:]
    available = {"real_single_texts": len(order)}
    for tier, texts in windows.items():
        fresh = [t for t in dict.fromkeys(texts) if t not in origin and t not in held]
        available[tier] = len(fresh)
        rng.shuffle(fresh)
        for t in fresh if len(order) < n else []:
            origin[t] = tier
            order.append(t)
    while len(order) < n:  # synthetic last resort: two random real sentences joined
        text = f"{rng.choice(singles)} {rng.choice(singles)}"
        if text not in origin and text not in held:
            origin[text] = "random_pairs_of_real_sentences"
            order.append(text)
    texts = order[:n]
    used: dict[str, int] = {}
    for t in texts:
        used[origin[t]] = used.get(origin[t], 0) + 1
    return texts, used, available


def embed_cached(texts: list[str], desc: str) -> np.ndarray:
    """MiniLM embeddings of texts, cached per chunk under /tmp by content hash (the gateway's encoder:
    ONNX Runtime on every core, same vectors as sentence-transformers, so older chunks stay valid)."""
    from cachegw.embeddings.encoder import make_encoder

    CACHE.mkdir(parents=True, exist_ok=True)
    encoder, parts = make_encoder("auto", threads=os.cpu_count() or 1), []
    with tqdm(total=len(texts), desc=f"embed {desc}", file=sys.stderr, unit="text") as bar:
        for start in range(0, len(texts), CHUNK):
            chunk = texts[start : start + CHUNK]
            key = hashlib.sha1("\x00".join(["all-MiniLM-L6-v2", *chunk]).encode()).hexdigest()[:24]
            path = CACHE / f"{key}.npy"
            if path.exists():
                parts.append(np.load(path))
                bar.update(len(chunk))
                continue
            vecs = []
            for sub in range(0, len(chunk), 1024):
                vecs.append(encoder.encode(chunk[sub : sub + 1024]))
                bar.update(len(vecs[-1]))
            parts.append(np.concatenate(vecs))
            np.save(tmp := path.with_suffix(".part.npy"), parts[-1])
            os.replace(tmp, path)
    return np.ascontiguousarray(np.concatenate(parts), dtype=np.float32)


def time_single(
    search: Search, xq: np.ndarray, warmup: int = 20
) -> tuple[list[float], np.ndarray, np.ndarray]:
    """One query per call, as the gateway looks up: per-call ms, top-1 ids, top-1 cosines."""
    for j in range(min(warmup, len(xq))):
        search(xq[j])
    lat, ids, scores = [], np.empty(len(xq), np.int64), np.empty(len(xq), np.float32)
    for j in range(len(xq)):
        t0 = time.perf_counter()
        ids[j], scores[j] = search(xq[j])
        lat.append((time.perf_counter() - t0) * 1e3)
    return lat, ids, scores


def p50s(searches: dict[str, Search], xq: np.ndarray, block: int = 50) -> dict[str, float]:
    """p50 ms of each search, taking turns in blocks of queries so load drift on this shared machine hits all
    alike (per-query turns would not do: faiss' OpenMP and numpy's OpenBLAS threads spin-wait after a call
    and slow down whichever library runs next)."""
    lat: dict[str, list[float]] = {name: [] for name in searches}
    for start in range(0, len(xq), block):
        for name, search in searches.items():
            search(xq[start])  # warm-up after the switch
            for q in xq[start : start + block]:
                t0 = time.perf_counter()
                search(q)
                lat[name].append((time.perf_counter() - t0) * 1e3)
    return {f"{name}_p50_ms": round(pct(v, 50), 3) for name, v in lat.items()}


def faiss_top1(index: Any, ef_search: int | None = None) -> Search:
    params = faiss.SearchParametersHNSW(efSearch=ef_search) if ef_search else None

    def search(q: np.ndarray) -> tuple[int, float]:
        dist, lab = index.search(q[None, :], 1, params=params)
        return int(lab[0, 0]), float(dist[0, 0])

    return search


def numpy_top1(xb: np.ndarray) -> Search:
    def search(q: np.ndarray) -> tuple[int, float]:
        sims = xb @ q
        j = int(sims.argmax())
        return j, float(sims[j])

    return search


def scoped_top1(index: ScopedIndex) -> Search:
    return lambda q: index.search("bench", q)[0]


def build_hnsw(xb: np.ndarray, ef_construction: int) -> tuple[Any, float]:
    index = faiss.IndexHNSWFlat(xb.shape[1], HNSW_M, faiss.METRIC_INNER_PRODUCT)
    index.hnsw.efConstruction = ef_construction
    t0 = time.perf_counter()
    for start in tqdm(
        range(0, len(xb), 20_000), desc=f"hnsw n={len(xb)} efC={ef_construction}", file=sys.stderr
    ):
        index.add(xb[start : start + 20_000])
    return index, round(time.perf_counter() - t0, 1)


def build_scoped(xb: np.ndarray, threshold: int = HNSW_THRESHOLD) -> tuple[ScopedIndex, dict]:
    """The production path: ScopedIndex.rebuild of one scope (flat or HNSW by size), build time, bytes."""
    index = ScopedIndex(dim=xb.shape[1], hnsw_threshold=threshold, background=False)
    t0 = time.perf_counter()
    index.rebuild((("bench", i, xb[i]) for i in range(len(xb))), total=len(xb), progress=len(xb) > 50_000)
    stats = index.stats()
    info = {"kind": index.scope_kind("bench"), "build_s": round(time.perf_counter() - t0, 1)}
    return index, info | {"bytes_per_entry": round(stats["bytes"] / len(xb), 1), **stats}


class Eval:
    """Held-out queries with their exact answers at one corpus size; scores an approximate search."""

    def __init__(self, xb: np.ndarray, xq: np.ndarray, is_para: np.ndarray) -> None:
        flat = faiss.IndexFlatIP(xb.shape[1])
        flat.add(xb)
        dist, lab = flat.search(xq, 1)  # batched exact search: BLAS makes this fast even at 1M
        self.xq, self.gt_ids, self.gt_scores = xq, lab[:, 0], dist[:, 0]
        self.masks = {"para": is_para, "neg": ~is_para, "cos_ge_0.8": self.gt_scores >= 0.8}

    def run(self, search: Search) -> dict[str, float | None]:
        lat, ids, scores = time_single(search, self.xq)
        hit = (ids == self.gt_ids) | (scores >= self.gt_scores - 1e-5)  # a tie is as good as the answer
        out: dict[str, float | None] = {"p50_ms": round(pct(lat, 50), 3), "p99_ms": round(pct(lat, 99), 3)}
        for name, mask in self.masks.items():
            out[f"recall_{name}"] = round(float(hit[mask].mean()), 4) if mask.any() else None
        return out


class _Instant:
    """Returns fixed unit vectors at once: isolates the batcher's own cost (timer, thread hop, fan-out)."""

    dim = 384

    def encode(self, texts: list[str]) -> np.ndarray:
        return np.full((len(texts), self.dim), self.dim**-0.5, np.float32)


async def _batcher_rounds(encoder: Any, lone: list[str], work: list[str], clients: int) -> dict[str, Any]:
    """Interleaved, so load drift on this shared machine hits both sides alike.

    Lone requests: each text encoded directly, then through the batcher. Throughput: rounds of `clients`
    texts encoded one by one, then the same texts sent by `clients` concurrent callers.
    """
    from cachegw.embeddings.batcher import EmbeddingBatcher

    batcher = EmbeddingBatcher(encoder, window_ms=2.0, max_batch=64)
    direct, via, serial, concurrent = [], [], 0.0, 0.0
    for t in lone:
        t0 = time.perf_counter()
        encoder.encode([t])
        t1 = time.perf_counter()
        await batcher.embed(t)
        direct.append((t1 - t0) * 1e3)
        via.append((time.perf_counter() - t1) * 1e3)
    before = batcher.batches
    for start in range(0, len(work), clients):
        chunk = work[start : start + clients]
        t0 = time.perf_counter()
        for t in chunk:
            encoder.encode([t])
        t1 = time.perf_counter()
        await asyncio.gather(*(batcher.embed(t) for t in chunk))
        serial, concurrent = serial + t1 - t0, concurrent + time.perf_counter() - t1
    batcher.close()
    rounds = batcher.batches - before
    return {"direct": direct, "via": via, "serial": serial, "concurrent": concurrent, "rounds": rounds}


def bench_batcher(texts: list[str], clients: int = 32, per_client: int = 8) -> dict:
    """Lone-request latency and `clients` concurrent callers' throughput vs one-by-one encoder calls."""
    from cachegw.embeddings.encoder import make_encoder

    enc, work = make_encoder("auto"), texts[: clients * per_client]
    enc.encode(texts[:64])  # load and warm up
    r = asyncio.run(_batcher_rounds(enc, texts[len(work) : len(work) + 100], work, clients))
    overhead = asyncio.run(_batcher_rounds(_Instant(), texts[:300], [], clients))["via"]
    return {
        "window_ms": 2.0,
        "direct_single_p50_ms": round(pct(r["direct"], 50), 2),
        "batcher_alone_p50_ms": round(pct(r["via"], 50), 2),
        "batcher_alone_p99_ms": round(pct(r["via"], 99), 2),
        "batcher_overhead_p50_ms": round(pct(overhead, 50), 2),
        f"concurrent_{clients}_texts_per_s": round(len(work) / r["concurrent"], 1),
        "one_by_one_texts_per_s": round(len(work) / r["serial"], 1),
        "speedup": round(r["serial"] / r["concurrent"], 2),
        "mean_batch_size": round(len(work) / max(1, r["rounds"]), 1),
    }


def table(title: str, rows: list[dict], cols: list[str]) -> None:
    print(f"\n{title}\n" + " ".join(f"{c:>13.13}" for c in cols))
    for r in rows:
        print(" ".join(f"{r.get(c, '-')!s:>13}" for c in cols))


def size_row(xb: np.ndarray, ev: Eval, flat_samples: int, hnsw: tuple[Any, float] | None = None) -> dict:
    """Exact (faiss flat, numpy, ScopedIndex flat tier) vs HNSW at one scope size."""
    index, secs = hnsw or build_hnsw(xb, EF_CONSTRUCTION)
    flat = faiss.IndexFlatIP(xb.shape[1])
    flat.add(xb)
    searches = {"faiss_flat": faiss_top1(flat), "numpy": numpy_top1(xb), "hnsw": faiss_top1(index, EF_SEARCH)}
    if len(xb) <= 200_000:
        scoped, _ = build_scoped(xb, threshold=len(xb) + 1)
        searches["scoped_flat"] = scoped_top1(scoped)
    row = {"n": len(xb), **p50s(searches, ev.xq[:flat_samples]), "hnsw_build_s": secs}
    return row | ev.run(faiss_top1(index, EF_SEARCH))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--queries", type=int, default=2000, help="paraphrase queries (+ half as many negatives)")
    ap.add_argument("--ef-construction", default=str(EF_CONSTRUCTION), help="comma list to sweep")
    ap.add_argument("--ef-search", default="16,32,64,128,256", help="comma list to sweep")
    ap.add_argument("--sizes", default="10000,20000,50000,100000", help="smaller scope sizes: exact vs HNSW")
    ap.add_argument(
        "--flat-samples", type=int, default=300, help="queries timed on exact search (slow at 1M)"
    )
    ap.add_argument("--torch-threads", type=int, default=0, help="for embedding; 0: torch's default")
    ap.add_argument("--no-batcher", action="store_true")
    args = ap.parse_args()
    sizes = sorted({s for s in map(int, args.sizes.split(",")) if s < args.n})
    efcs = sorted({int(x) for x in args.ef_construction.split(",")} | {EF_CONSTRUCTION})
    efss = sorted({int(x) for x in args.ef_search.split(",")} | {EF_SEARCH})
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)

    say("[1/5] corpus and held-out queries")
    queries = pick_queries(args.queries, args.queries // 2)
    texts, used, available = corpus(args.n, queries, first=min(sizes + [args.n]))
    say(f"corpus n={len(texts)} used={used} available={available}")
    say("[2/5] embeddings (cached under /tmp)")
    xb = embed_cached(texts, "corpus")
    xq = embed_cached(queries["para"] + queries["neg"], "queries")
    is_para = np.arange(len(xq)) < len(queries["para"])
    head = {t: i for i, t in enumerate(texts[: min(sizes + [args.n])])}  # every partner sits in the head
    partner = np.array([head[t] for t in queries["para_partner"]])

    say("[3/5] exact ground truth; ScopedIndex.rebuild of one scope of n entries")
    ev = Eval(xb, xq, is_para)
    index, scoped = build_scoped(xb)
    scoped["search_p50_ms"] = p50s({"search": scoped_top1(index)}, xq)["search_p50_ms"]
    say(f"ScopedIndex: {scoped}")
    chosen = (index._scopes["bench"].inner, scoped["build_s"]) if scoped["kind"] == "hnsw" else None
    del index
    say("[4/5] efConstruction x efSearch sweep at n, then exact vs HNSW per size")
    sweep = []
    for efc in efcs:
        hnsw, secs = chosen if chosen and efc == EF_CONSTRUCTION else build_hnsw(xb, efc)
        for efs in efss:
            sweep.append(
                {"ef_construction": efc, "ef_search": efs, "build_s": secs, **ev.run(faiss_top1(hnsw, efs))}
            )
            say(f"sweep {sweep[-1]}")
        del hnsw  # at 1M each graph is ~1.8 GiB: never hold two swept ones at once
    by_size = []
    for size in sizes:
        by_size.append(size_row(xb[:size], Eval(xb[:size], xq, is_para), args.flat_samples))
        say(f"size {by_size[-1]}")
    by_size.append(size_row(xb, ev, args.flat_samples, chosen))
    batcher = {}
    if not args.no_batcher:
        say("[5/5] embedding batcher")
        batcher = bench_batcher(queries["para"] + queries["neg"])

    payload = {
        "n": args.n,
        "dim": int(xb.shape[1]),
        "hnsw": {"M": HNSW_M, "ef_construction": EF_CONSTRUCTION, "ef_search": EF_SEARCH},
        "queries": {"paraphrase": int(is_para.sum()), "hard_negative": int((~is_para).sum())},
        "exact_top1_is_paraphrase_partner": round(float((ev.gt_ids[is_para] == partner).mean()), 4),
        "corpus": {"used": used, "available": available},
        "scoped_index": scoped,
        "sweep": sweep,
        "by_size": by_size,
        "batcher": batcher,
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    cols = ["p50_ms", "p99_ms", "recall_para", "recall_neg", "recall_cos_ge_0.8"]
    table(f"HNSW M={HNSW_M} at n={args.n}", sweep, ["ef_construction", "ef_search", "build_s", *cols])
    exact_cols = [
        "n",
        "faiss_flat_p50_ms",
        "numpy_p50_ms",
        "scoped_flat_p50_ms",
        "hnsw_p50_ms",
        "hnsw_build_s",
    ]
    table(f"exact vs HNSW efC={EF_CONSTRUCTION} efS={EF_SEARCH}", by_size, exact_cols + cols[:3])
    table("ScopedIndex.rebuild + search", [scoped], ["kind", "build_s", "bytes_per_entry", "search_p50_ms"])
    if batcher:
        table("embedding batcher", [batcher], list(batcher))
    save("faiss_lookup", payload)


if __name__ == "__main__":
    main()
