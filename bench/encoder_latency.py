"""Query-embedding latency: the torch ``Encoder`` against the ONNX Runtime ``OnnxEncoder``, one run.

A semantic hit costs one single-query embedding, so its p50/p99 bounds the gateway's hit latency (target
p50 <= 15 ms through HTTP); batch-64 throughput is what the micro-batcher gets under load. Both encoders run
in this process with one intra-op thread each (what the gateway uses), interleaved in rounds with the order
alternating, so machine noise from anything else running lands on both. Queries are real: QQP question1
from ../shared/data/qqp_dev.csv when present, else a built-in list. The 1-minute load average is recorded at
start and end; ``--max-load`` waits (polling) for a quieter machine before measuring.

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.encoder_latency [--queries 300] [--fused] [--max-load 1.5]
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import time
from typing import Any

import numpy as np

from bench.common import SHARED_DATA, pct, save, say

FALLBACK_QUERIES = [
    "How do I reset my password?",
    "What is the capital of France?",
    "How long does shipping take to Canada?",
    "Can I change my delivery address after ordering?",
    "What is the best way to learn Python quickly?",
    "Why is the sky blue?",
    "How do I cancel my subscription?",
    "What are some good tips for self study?",
    "How can I improve my English speaking skills?",
    "Is it safe to eat raw cookie dough?",
    "What causes inflation in an economy?",
    "How do vaccines train the immune system?",
    "Which programming language should a beginner start with?",
    "How much water should I drink every day?",
    "What is the difference between a virus and bacteria?",
    "How do I get a refund for a damaged item?",
    "Why does my phone battery drain so fast?",
    "What is machine learning in simple words?",
    "How can I stop procrastinating?",
    "What is the meaning of life?",
]


def load_queries(n: int) -> tuple[list[str], str]:
    """``n`` distinct real short queries and where they came from."""
    path = SHARED_DATA / "qqp_dev.csv"
    if path.exists():
        seen: dict[str, None] = {}
        with path.open(newline="") as f:
            for row in csv.DictReader(f):
                q = " ".join((row.get("question1") or "").split())
                if q:
                    seen.setdefault(q, None)
                if len(seen) >= n:
                    break
        return list(seen), str(path)
    reps = -(-n // len(FALLBACK_QUERIES))
    return (FALLBACK_QUERIES * reps)[:n], "built-in list"


def load_avg() -> dict[str, Any]:
    """``uptime`` as printed plus the 1/5/15-minute load averages."""
    try:
        text = subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        text = ""
    one, five, fifteen = os.getloadavg()
    return {"uptime": text, "load1": round(one, 2), "load5": round(five, 2), "load15": round(fifteen, 2)}


def wait_for_quiet(max_load: float, poll_s: float, max_wait_s: float) -> None:
    """Poll until the 1-minute load drops below ``max_load`` (or give up after ``max_wait_s``)."""
    t0 = time.monotonic()
    while (load := os.getloadavg()[0]) >= max_load:
        if time.monotonic() - t0 > max_wait_s:
            say(f"load still {load:.2f} after {max_wait_s:.0f}s; measuring anyway")
            return
        say(f"1-minute load {load:.2f} >= {max_load}: waiting {poll_s:.0f}s")
        time.sleep(poll_s)


def timed(encoder: Any, texts: list[str]) -> float:
    t0 = time.perf_counter()
    encoder.encode(texts)
    return time.perf_counter() - t0


def summary(single: list[float], batch: list[float], batch_size: int) -> dict[str, float]:
    ms = [s * 1e3 for s in single]
    bms = [s * 1e3 for s in batch]
    return {
        "single_p50_ms": round(statistics.median(ms), 3),
        "single_p99_ms": round(pct(ms, 99), 3),
        "single_mean_ms": round(statistics.fmean(ms), 3),
        "single_min_ms": round(min(ms), 3),
        "batch_p50_ms": round(statistics.median(bms), 2),
        "batch_texts_per_s": round(batch_size / (statistics.median(bms) / 1e3), 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--queries", type=int, default=300, help="single-query embeddings timed per encoder")
    ap.add_argument("--rounds", type=int, default=10, help="interleaving rounds")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--batch-reps", type=int, default=3, help="batch calls per encoder per round")
    ap.add_argument("--threads", type=int, default=1, help="torch threads and ORT intra-op threads")
    ap.add_argument("--fused", action="store_true", help="also time the graph with ORT's offline BERT fusion")
    ap.add_argument("--max-load", type=float, default=0.0, help="wait for a 1-minute load below this first")
    ap.add_argument("--max-wait", type=float, default=900.0, help="seconds to wait for --max-load at most")
    args = ap.parse_args()

    import torch

    from cachegw.embeddings.encoder import Encoder
    from cachegw.embeddings.onnx_encoder import OnnxEncoder

    torch.set_num_threads(args.threads)
    queries, source = load_queries(args.queries)
    batch_pool, _ = load_queries(args.queries + args.batch * args.rounds)
    batch_pool = batch_pool[-args.batch * args.rounds :]
    if len(batch_pool) < args.batch:
        batch_pool = (batch_pool * args.batch)[: args.batch * args.rounds]

    encoders: dict[str, Any] = {"torch": Encoder(), "onnx": OnnxEncoder(threads=args.threads).load()}
    if args.fused:
        encoders["onnx-fused"] = OnnxEncoder(threads=args.threads, optimize=True).load()
    for enc in encoders.values():  # warm-up: first calls allocate, page in weights, build ORT kernels
        for q in queries[:20]:
            enc.encode([q])
        enc.encode(batch_pool[: args.batch])

    ref = encoders["torch"].encode(queries)
    parity = {
        name: round(float((enc.encode(queries) * ref).sum(axis=1).min()), 7)
        for name, enc in encoders.items()
        if name != "torch"
    }

    if args.max_load > 0:
        wait_for_quiet(args.max_load, poll_s=60.0, max_wait_s=args.max_wait)
    start_load = load_avg()
    say(f"start: {start_load['uptime']}")
    names = list(encoders)
    single: dict[str, list[float]] = {n: [] for n in names}
    batch: dict[str, list[float]] = {n: [] for n in names}
    per_round = -(-len(queries) // args.rounds)
    t_run = time.perf_counter()
    for r in range(args.rounds):
        chunk = queries[r * per_round : (r + 1) * per_round]
        texts = batch_pool[(r * args.batch) % len(batch_pool) :][: args.batch]
        order = names[r % len(names) :] + names[: r % len(names)]  # rotate who goes first
        for name in order:
            enc = encoders[name]
            single[name] += [timed(enc, [q]) for q in chunk]
            batch[name] += [timed(enc, texts) for _ in range(args.batch_reps)]
        say(
            f"round {r + 1}/{args.rounds}: "
            + ", ".join(f"{n} {statistics.median(single[n]) * 1e3:.2f} ms" for n in names)
        )
    end_load = load_avg()
    say(f"end: {end_load['uptime']}")

    results = {n: summary(single[n], batch[n], args.batch) for n in names}
    base = results["torch"]
    ratios = {
        n: {
            "single_p50_speedup": round(base["single_p50_ms"] / r["single_p50_ms"], 2),
            "single_p99_speedup": round(base["single_p99_ms"] / r["single_p99_ms"], 2),
            "batch_throughput_ratio": round(r["batch_texts_per_s"] / base["batch_texts_per_s"], 2),
        }
        for n, r in results.items()
        if n != "torch"
    }

    header = f"{'backend':<11} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8} {'b64 ms':>8} {'texts/s':>9}"
    print(f"\nsingle query ({len(queries)} from {source}) and batch {args.batch}, {args.threads} thread(s)")
    print(header)
    for n, r in results.items():
        print(
            f"{n:<11} {r['single_p50_ms']:>8.2f} {r['single_p99_ms']:>8.2f} {r['single_mean_ms']:>8.2f} "
            f"{r['batch_p50_ms']:>8.1f} {r['batch_texts_per_s']:>9.0f}"
        )
    for n, q in ratios.items():
        print(
            f"{n} vs torch: p50 {q['single_p50_speedup']:.2f}x faster, p99 {q['single_p99_speedup']:.2f}x, "
            f"batch throughput {q['batch_throughput_ratio']:.2f}x; min cosine to torch {parity[n]}"
        )
    print(f"load: start {start_load['uptime']} | end {end_load['uptime']}")

    import onnxruntime

    save(
        "encoder_latency",
        {
            "queries": len(queries),
            "query_source": source,
            "rounds": args.rounds,
            "batch_size": args.batch,
            "batch_calls_per_encoder": len(batch["torch"]),
            "threads": args.threads,
            "onnxruntime": onnxruntime.__version__,
            "onnx_model": str(encoders["onnx"].model_file),
            "results": results,
            "ratios_vs_torch": ratios,
            "min_cosine_to_torch": parity,
            "load_start": start_load,
            "load_end": end_load,
            "seconds": round(time.perf_counter() - t_run, 1),
            "median_words_per_query": int(np.median([len(q.split()) for q in queries])),
        },
    )


if __name__ == "__main__":
    main()
