"""Swap against recompute for preempted sequences ([engine] preemption_mode), on the embedded SmolLM2.

Two measurements, each alternating the modes on one engine (the same weights and pool; the swap space
switched on and off between runs), with fresh random prompts every run so no run finds another's
blocks in the prefix cache:

1. Per sequence: what bringing back ``L`` computed tokens costs. Swap: copying its blocks out to host
   memory and back into fresh pool blocks (``SwapSpace.swap_out`` + ``resume``). Recompute, two ways:
   a prefill of ``L`` tokens alone (one request, one token sampled), and what those ``L`` tokens add
   to a step that decodes a batch anyway (``bench/preemption_steps.py``): a resumed sequence joins
   running ones, so the step's fixed cost (reading the weights) is paid either way. The smallest ``L``
   where swap beats the added cost is the crossover ``auto`` uses (``swap_min_tokens``).
2. Under memory pressure: ``--requests`` requests of ``L`` prompt tokens and ``--new`` generated
   tokens at once, in a pool that holds half of the prompts and none of their growth, so running
   sequences are preempted for the blocks their decodes need (the swap counters confirm it): generated
   tokens per second, and for the resumed sequences the time from re-admission to their next token
   (their TTFT after resuming), from preemption to that token, and their end-to-end latency. Recompute
   runs twice: as configured (a re-admitted sequence finds its full blocks in the prefix cache while
   nothing has evicted them; the share found is reported) and with the prefix cache off (what
   recomputing costs once they are gone).

Usage: python -m bench.preemption [--lengths 64,256] [--requests 8] [--new 48] [--repeats 2]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from bench.common import save, say
from bench.preemption_steps import added_step_cost, pressure_run, prompt

CROSSOVER_LENGTHS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
ADDED_LENGTHS = (1, 2, 4, 8, 16, 32, 64)  # recompute inside a decoding batch


def recompute_cost(llm, length: int, rng: random.Random) -> float:
    """Seconds to prefill ``length`` fresh tokens alone and sample one."""
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


def per_sequence(llm, repeats: int, rng: random.Random) -> dict[int, dict[str, float]]:
    costs: dict[int, dict[str, float]] = {}
    for length in CROSSOVER_LENGTHS:
        rec, sw = [], []
        for _ in range(repeats):
            rec.append(recompute_cost(llm, length, rng))
            sw.append(swap_cost(llm, length, rng))
        row = {"recompute_alone_ms": statistics.median(rec) * 1e3, "swap_ms": statistics.median(sw) * 1e3}
        if length in ADDED_LENGTHS:
            row["recompute_added_ms"] = added_step_cost(llm.engine, length, max(9, 4 * repeats), rng) * 1e3
        costs[length] = row
        say(f"L={length}: {', '.join(f'{k} {v:.2f}' for k, v in row.items())}")
    return costs


def crossover(costs: dict[int, dict[str, float]], key: str) -> int | None:
    """The smallest length from which swap stays cheaper than ``key``."""
    lengths = [n for n in sorted(costs) if key in costs[n]]
    for i, n in enumerate(lengths):
        if all(costs[m]["swap_ms"] < costs[m][key] for m in lengths[i:]):
            return n
    return None


def median(runs: list[dict], key: str) -> float | None:
    vals = [x[key] for x in runs if x[key] is not None]
    return statistics.median(vals) if vals else None


# recompute with the prefix cache off: what recomputing costs once the preempted blocks are evicted
MODES = ("swap", "recompute", "recompute-no-prefix-cache")
KEYS = ("tokens_per_s", "resumed_ttft_s", "resumed_stall_s", "preempted_e2e_s", "all_e2e_s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="64,256")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    from cachegw.backend import LLM

    lengths = [int(x) for x in args.lengths.split(",")]
    llm = LLM(
        device="cpu", compile="off", kv_cache_tokens=16384, max_num_seqs=args.requests, preemption_mode="swap"
    )
    from cachegw.backend.core.swap import SwapSpace  # after LLM(): it sets torch's threads up first

    engine = llm.engine
    swap = engine.scheduler.swap
    assert isinstance(swap, SwapSpace)
    rng = random.Random(0)
    costs = per_sequence(llm, args.repeats, rng)
    runs: dict[int, dict[str, list[dict]]] = {}
    for length in lengths:
        runs[length] = {mode: [] for mode in MODES}
        for r in range(args.repeats):
            for mode in MODES[r % 3 :] + MODES[: r % 3]:  # each mode first in turn
                engine.scheduler.swap = swap if mode == "swap" else None
                engine.block_manager.enable_prefix_caching = mode != "recompute-no-prefix-cache"
                run = pressure_run(engine, length, args.requests, args.new, rng)
                assert run["preemptions"] > 0, f"L={length} {mode}: the pool preempted nothing"
                assert (run["swapped_out"] > 0) == (mode == "swap"), run
                runs[length][mode].append(run)
                say(f"L={length} {mode}: {run}")
        engine.scheduler.swap = swap
        engine.block_manager.enable_prefix_caching = True
    summary = {}
    for length, modes in runs.items():
        row: dict[str, float | None] = {}
        for key in KEYS:
            values = {m: median(modes[m], key) for m in MODES}
            row.update({f"{key}_{m}": v for m, v in values.items()})
            for m in MODES[1:]:  # swap over each recompute arm
                a, b = values["swap"], values[m]
                row[f"{key}_swap_over_{m}"] = round(a / b, 3) if a and b else None
        row["recompute_prefix_hit"] = median(modes["recompute"], "recompute_prefix_hit")
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
            "crossover_tokens_alone": crossover(costs, "recompute_alone_ms"),
            "crossover_tokens_added": crossover(costs, "recompute_added_ms"),
            "under_pressure": summary,
            "runs": runs,
        },
    )


if __name__ == "__main__":
    main()
