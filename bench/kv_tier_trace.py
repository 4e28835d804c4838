"""Mooncake's conversation trace replayed on SmolLM2 with a KV pool small enough to evict: prefix-cache hit
ratio and TTFT with the pool alone, pool + RAM tier, pool + RAM + disk tier, against the trace's ideal
(infinite cache); then the TTFT of returning conversations after an engine restart, cold vs the disk tier.

Scaled to this machine: ``--conversations`` conversations drawn at random (seed 0) from the trace's 7,373,
all their requests in arrival order (the last turn of each multi-turn one held out for the restart); each
512-token ``hash_id`` becomes ``--tokens-per-id`` synthetic token ids (a seeded draw per id, so equal ids
are equal prefixes); a prompt keeps at most ``--max-ids`` ids and its length is ``input_length`` scaled
by the same factor.
Each request runs alone (max_tokens 1: TTFT is the prefill), on the three engines in turn, so machine
load falls on all three alike; arrival times give the order only (an open-loop replay on two shared
cores would measure the queue, not the cache).

    .venv/bin/python -m bench.kv_tier_trace  [--requests 100 --tokens-per-id 16 --max-ids 10]
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.common import SHARED_DATA, pct, save, say

BLOCK = 8  # KV block = one hash id's tokens (--tokens-per-id 8), as in the trace


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    ids: tuple[int, ...]


def load_trace(
    path, conversations: int, per_id: int, max_ids: int, vocab: int, multi_turn: bool = False
) -> tuple[list[Request], list[Request]]:
    """A random sample of the trace's conversations (a conversation = requests sharing their first two hash
    ids), every request of each in arrival order: the replay; and each multi-turn conversation's last
    turn, held out: the turns that return after the restart. ``multi_turn``: draw among conversations of
    two turns or more only (the returning ones, which exercise the tiers)."""
    with open(path) as f:
        rows = sorted((json.loads(line) for line in f), key=lambda r: r["timestamp"])
    sizes = collections.Counter(tuple(r["hash_ids"][:2]) for r in rows)
    keys = sorted(k for k, n in sizes.items() if n > 1 or not multi_turn)
    picked = set(random.Random(0).sample(keys, conversations))
    reqs: list[tuple[tuple[int, ...], Request]] = []
    for row in rows:
        if tuple(row["hash_ids"][:2]) not in picked:
            continue
        ids = tuple(row["hash_ids"][:max_ids])
        tokens = [t for h in ids for t in random.Random(h).choices(range(100, vocab), k=per_id)]
        length = min(len(tokens), max(2, round(row["input_length"] * per_id / 512)))
        reqs.append((ids[:2], Request(tokens[:length], ids)))
    last = {key: i for i, (key, _) in enumerate(reqs)}
    turns = collections.Counter(key for key, _ in reqs)
    held = {i for key, i in last.items() if turns[key] > 1}
    return [r for i, (_, r) in enumerate(reqs) if i not in held], [reqs[i][1] for i in sorted(held)]


def seen_prefixes(reqs: list[Request], per_id: int) -> set[tuple[int, ...]]:
    """The hash-id prefixes whose tokens these requests held whole."""
    return {r.ids[: i + 1] for r in reqs for i in range(len(r.prompt) // per_id)}


def ideal_hits(reqs: list[Request], per_id: int, seen: set[tuple[int, ...]] | None = None) -> tuple[int, int]:
    """Tokens an infinite prefix cache would serve (whole KV blocks of already seen hash-id prefixes, the
    last token always computed), and the prompt tokens, over ``reqs`` in order."""
    seen = set() if seen is None else seen
    hits = total = 0
    for r in reqs:
        total += len(r.prompt)
        cached_ids = 0
        while cached_ids < len(r.ids) and r.ids[: cached_ids + 1] in seen:
            cached_ids += 1
        hits += min(cached_ids * per_id, len(r.prompt) - 1) // BLOCK * BLOCK
        seen |= seen_prefixes([r], per_id)
    return hits, total


def run(llm, prompt: list[int]) -> tuple[float, int]:
    from cachegw.backend import SamplingParams

    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))[0]
    return out.metrics.time_to_first_token, out.num_cached_tokens


def summary(ttfts: list[float], cached: int, prompt: int, stats) -> dict:
    return {
        "hit_ratio": round(cached / prompt, 4),
        "hits_by_tier_tokens": stats.prefix_cache_hits_by_tier,
        "ttft_p50_ms": round(pct(ttfts, 50) * 1e3, 1),
        "ttft_p99_ms": round(pct(ttfts, 99) * 1e3, 1),
        "ttft_mean_ms": round(sum(ttfts) / len(ttfts) * 1e3, 1),
        "tier_blocks": stats.kv_tier.blocks,
        "load_ms_per_block": {
            tier: round(stats.kv_tier.load_seconds_sum[tier] / n * 1e3, 3)
            for tier, buckets in stats.kv_tier.load_seconds.items()
            if (n := buckets[-1][1])
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(SHARED_DATA / "mooncake_conversation_trace.jsonl"))
    ap.add_argument("--conversations", type=int, default=40)
    ap.add_argument("--multi-turn", action="store_true", help="sample multi-turn conversations only")
    ap.add_argument("--tokens-per-id", type=int, default=BLOCK)
    ap.add_argument("--max-ids", type=int, default=48)
    ap.add_argument("--pool-tokens", type=int, default=768)
    ap.add_argument("--ram-tokens", type=int, default=1536)
    ap.add_argument("--threads", type=int, default=1, help="1: two threads collapse on a loaded machine")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from cachegw.backend import LLM

    disk_dir = tempfile.mkdtemp(prefix="kvtier-bench-")
    kv_token = 46080  # SmolLM2 float32 bytes per token
    common = dict(
        dtype="float32",
        quantization="none",
        kv_cache_tokens=args.pool_tokens,
        max_num_seqs=4,
        block_size=BLOCK,
    )
    engines = {
        "pool": LLM(compile="off", **common),
        "pool+ram": LLM(compile="off", **common, kv_offload_bytes=args.ram_tokens * kv_token),
        "pool+ram+disk": LLM(
            compile="off",
            **common, kv_offload_bytes=args.ram_tokens * kv_token, kv_offload_dir=disk_dir,
            kv_offload_disk_bytes=8 << 30,
        ),
    }  # fmt: skip
    vocab = engines["pool"].engine.runner.spec.vocab_size
    trace, returning = load_trace(
        args.trace, args.conversations, args.tokens_per_id, args.max_ids, vocab, args.multi_turn
    )
    for llm in engines.values():  # warm-up (kernels, allocator), under a salt of its own: no hits
        llm.generate([list(range(200, 500))], cache_salt="warm-up")
    before = {name: llm.engine.stats() for name, llm in engines.items()}
    ttfts: dict[str, list[float]] = {name: [] for name in engines}
    cached = dict.fromkeys(engines, 0)
    start = time.perf_counter()
    for i, req in enumerate(trace):
        for name, llm in engines.items():
            t, hit = run(llm, req.prompt)
            ttfts[name].append(t)
            cached[name] += hit
        if (i + 1) % 20 == 0:
            say(f"{i + 1}/{len(trace)} requests, {time.perf_counter() - start:.0f} s")
    ideal, prompt_tokens = ideal_hits(trace, args.tokens_per_id)
    results = {
        name: summary(ttfts[name], cached[name], prompt_tokens, llm.engine.stats())
        for name, llm in engines.items()
    }
    for name, b in before.items():
        say(f"{name}: {results[name]} (warm-up hits {b.prefix_cache_hits})")

    # Restart: the tiered engine shuts down (its pool and RAM go to disk); a new one on the same directory
    # vs a cold start (the pool-only engine with its prefix cache dropped) on the conversations' next turns.
    engines["pool+ram+disk"].engine.close()
    del engines["pool+ram+disk"], engines["pool+ram"]
    gc.collect()
    restarted = LLM(
        compile="off", **common, kv_offload_bytes=args.ram_tokens * kv_token, kv_offload_dir=disk_dir
    )
    cold_engine = engines["pool"]
    seen = seen_prefixes(trace, args.tokens_per_id)
    restarted.generate([list(range(200, 500))], cache_salt="warm-up")
    after: dict[str, list[float]] = {"cold": [], "disk": []}
    hits = {"cold": 0, "disk": 0}
    for req in returning:
        cold_engine.engine.block_manager.reset_prefix_cache()
        for name, llm in (("cold", cold_engine), ("disk", restarted)):
            t, hit = run(llm, req.prompt)
            after[name].append(t)
            hits[name] += hit
    tokens = sum(len(r.prompt) for r in returning)
    restart = {
        name: {
            "hit_ratio": round(hits[name] / tokens, 4),
            "ttft_p50_ms": round(pct(after[name], 50) * 1e3, 1),
            "ttft_p99_ms": round(pct(after[name], 99) * 1e3, 1),
            "ttft_mean_ms": round(sum(after[name]) / len(after[name]) * 1e3, 1),
        }
        for name in after
    }
    restart["requests"] = len(returning)  # type: ignore[assignment]
    restart["ideal_hit_ratio"] = round(ideal_hits(returning, args.tokens_per_id, set(seen))[0] / tokens, 4)  # type: ignore[assignment]
    say(f"restart: {restart}")
    disk_bytes = sum(f.stat().st_size for f in Path(disk_dir).rglob("*.kv"))
    restarted.engine.close()
    shutil.rmtree(disk_dir, ignore_errors=True)
    save(
        "kvtier_multi_turn" if args.multi_turn else "kvtier",
        {
            "command": "python -m bench.kv_tier_trace "
            + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "trace"),
            "load_average": os.getloadavg(),
            "scaling": {
                "conversations": args.conversations,
                "requests": len(trace),
                "tokens_per_hash_id": args.tokens_per_id,
                "max_hash_ids": args.max_ids,
                "prompt_tokens": prompt_tokens,
                "pool_tokens": args.pool_tokens,
                "ram_tier_tokens": args.ram_tokens,
                "disk_tier_bytes_at_end": disk_bytes,
            },
            "ideal_hit_ratio": round(ideal / prompt_tokens, 4),
            "replay": results,
            "restart": restart,
            "seconds": round(time.perf_counter() - start, 1),
        },
    )


if __name__ == "__main__":
    main()
