"""Swap against recompute for preempted sequences ([engine] preemption_mode), on the embedded SmolLM2.

Two measurements, each alternating the modes on one engine (the same weights and pool; the swap space
switched on and off between runs), with fresh random prompts every run so no run finds another's
blocks in the prefix cache:

1. Per sequence: what bringing back ``L`` computed tokens costs. Recompute: a prefill of ``L`` tokens
   (one request alone, one token sampled). Swap: copying its blocks out to host memory and back into
   fresh pool blocks (``SwapSpace.swap_out`` + ``resume``). The smallest ``L`` where swap is cheaper
   is the crossover ``auto`` uses (``swap_min_tokens``).
2. Under memory pressure: ``--requests`` requests of ``L`` prompt tokens and ``--new`` generated
   tokens at once, the pool held to about half of what they need, so sequences are preempted:
   generated tokens per second, and the TTFT and end-to-end latency of the requests that were
   preempted, swap over recompute.

Usage: python -m bench.preemption [--lengths 64,256] [--requests 8] [--new 32] [--repeats 2]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from bench.common import save, say


def prompt(length: int, rng: random.Random) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(length)]


def recompute_cost(llm, length: int, rng: random.Random) -> float:
    """Seconds to prefill ``length`` fresh tokens and sample one: what recomputing them costs."""
    from cachegw.backend import SamplingParams

    t = time.perf_counter()
    llm.generate(prompt(length, rng), SamplingParams(temperature=0.0, max_tokens=1))
    return time.perf_counter() - t


def swap_cost(llm, length: int, rng: random.Random) -> float:
    """Seconds to copy the blocks of ``length`` computed tokens out to host memory and back."""
    from cachegw.backend import SamplingParams
    from cachegw.backend.core.sequence import Sequence
    from cachegw.backend.core.swap import SwapSpace

    engine = llm.engine
    bm = engine.block_manager
    swap = SwapSpace(bm, engine.runner.read_block, engine.runner.write_block, "swap", 1 << 40)
    seq = Sequence("cost", prompt(length, rng), SamplingParams())
    seq.block_table = bm.take_blocks(-(-length // bm.block_size))
    seq.num_computed_tokens = length
    t = time.perf_counter()
    assert swap.swap_out(seq)
    bm.free_blocks(seq)
    assert swap.resume(seq, 0) == 0
    elapsed = time.perf_counter() - t
    bm.free_blocks(seq)
    return elapsed


def pressure_run(llm, length: int, requests: int, new: int, rng: random.Random) -> dict:
    """The requests at once in a pool of about half what they need; their outcome."""
    from cachegw.backend import SamplingParams

    engine = llm.engine
    bm = engine.block_manager
    need = requests * -(-(length + new) // bm.block_size)
    longest = -(-(length + new) // bm.block_size)
    keep = max(longest + 1, need // 2)
    held = bm.take_blocks(bm.num_free_blocks - keep)  # out of play for this run
    before = engine.stats()
    t = time.perf_counter()
    outs = llm.generate(
        [prompt(length, rng) for _ in range(requests)],
        SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True),
    )
    wall = time.perf_counter() - t
    for b in held:
        bm.release(b)
    after = engine.stats()
    hit = [o.metrics for o in outs if o.metrics.num_preemptions]
    return {
        "seconds": wall,
        "tokens_per_s": sum(len(o.outputs[0].token_ids) for o in outs) / wall,
        "preemptions": after.num_preemptions - before.num_preemptions,
        "swapped_out": after.swap.swapped_out - before.swap.swapped_out,
        "preempted_requests": len(hit),
        "preempted_ttft_s": statistics.mean(m.first_token_time - m.arrival_time for m in hit)
        if hit
        else None,
        "preempted_e2e_s": statistics.mean(m.finish_time - m.arrival_time for m in hit) if hit else None,
    }


def median(runs: list[dict], key: str) -> float | None:
    vals = [x[key] for x in runs if x[key] is not None]
    return statistics.median(vals) if vals else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="64,256")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    from cachegw.backend import LLM
    from cachegw.backend.core.swap import SwapSpace

    lengths = [int(x) for x in args.lengths.split(",")]
    llm = LLM(
        device="cpu", compile="off", kv_cache_tokens=16384, max_num_seqs=args.requests, preemption_mode="swap"
    )
    engine = llm.engine
    swap = engine.scheduler.swap
    assert isinstance(swap, SwapSpace)
    rng = random.Random(0)
    costs: dict[int, dict[str, float]] = {}
    for length in sorted({16, 32, 64, 128, 256, 512, *lengths}):
        rec, sw = [], []
        for _ in range(args.repeats):
            rec.append(recompute_cost(llm, length, rng))
            sw.append(swap_cost(llm, length, rng))
        costs[length] = {"recompute_ms": statistics.median(rec) * 1e3, "swap_ms": statistics.median(sw) * 1e3}
        say(
            f"L={length}: recompute {costs[length]['recompute_ms']:.1f} ms, "
            f"swap {costs[length]['swap_ms']:.2f} ms"
        )
    crossover = next((n for n, c in sorted(costs.items()) if c["swap_ms"] < c["recompute_ms"]), None)
    runs: dict[int, dict[str, list[dict]]] = {}
    for length in lengths:
        runs[length] = {"swap": [], "recompute": []}
        for r in range(args.repeats):
            for mode in ("swap", "recompute") if r % 2 == 0 else ("recompute", "swap"):
                engine.scheduler.swap = swap if mode == "swap" else None
                runs[length][mode].append(pressure_run(llm, length, args.requests, args.new, rng))
        engine.scheduler.swap = swap
        s, c = runs[length]["swap"], runs[length]["recompute"]
        tput = statistics.median(x["tokens_per_s"] for x in s) / statistics.median(
            x["tokens_per_s"] for x in c
        )
        say(
            f"L={length}: throughput swap/recompute {tput:.2f}x; "
            f"preemptions {[x['preemptions'] for x in s + c]}"
        )
    summary = {}
    for length, modes in runs.items():
        row: dict[str, float | None] = {}
        for key in ("tokens_per_s", "preempted_ttft_s", "preempted_e2e_s"):
            a, b = (median(modes[m], key) for m in ("swap", "recompute"))
            row[f"{key}_swap"], row[f"{key}_recompute"] = a, b
            row[f"{key}_ratio"] = round(a / b, 3) if a and b else None
        summary[length] = row
        say(f"L={length}: {row}")
    save(
        "preemption",
        {
            "command": f"python -m bench.preemption --lengths {args.lengths} --requests {args.requests} "
            f"--new {args.new} --repeats {args.repeats}",
            "model": "SmolLM2-135M-Instruct (embedded GGUF, default int4 weights), CPU, compile off",
            "note": "2-core machine shared with other work; modes alternate on one engine",
            "per_sequence_cost": costs,
            "crossover_tokens": crossover,
            "under_pressure": summary,
            "runs": runs,
        },
    )


if __name__ == "__main__":
    main()
