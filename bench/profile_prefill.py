"""Where a prompt's prefill goes: torch.profiler over the steps that compute one N-token prompt
(no prefix cache) up to its first token, operator self-times in profile_decode's groups
(projections, attention, other ops) and what no operator accounts for.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python -m bench.profile_prefill [--tokens 2000] [--modes auto,none]
"""

from __future__ import annotations

import argparse
import gc
import random
import time

import torch

from bench.common import save, say
from bench.profile_decode import _group


def profile(mode: str, tokens: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from cachegw.backend import LLM, SamplingParams

    weights, *flags = mode.split("+")
    llm = LLM(
        quantization=weights,
        cpu_kernels=flags[0] if flags else "auto",
        dtype="float32",
        kv_cache_tokens=tokens + 64,
        max_num_seqs=1,
        enable_prefix_caching=False,
        compile="off",
    )
    engine = llm.engine
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    engine.add_request("warm", [rng.randrange(100, 49152) for _ in range(200)], params)
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("p", [rng.randrange(100, 49152) for _ in range(tokens)], params)
    steps = 0
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        wall = (time.perf_counter() - start) * 1000
    totals: dict[str, float] = {"projections": 0.0, "attention": 0.0, "other ops": 0.0}
    events = sorted(prof.key_averages(), key=lambda ev: -ev.self_cpu_time_total)
    for ev in events:
        totals[_group(ev.key)] += ev.self_cpu_time_total / 1000
    top = {ev.key: round(ev.self_cpu_time_total / 1000, 1) for ev in events[:8]}
    del llm, engine
    gc.collect()
    ms = {k: round(v, 1) for k, v in totals.items()}
    ms["outside operators"] = round(wall - sum(totals.values()), 1)
    return {"prefill_ms": round(wall, 1), "steps": steps, "ms": ms, "top_operators_ms": top}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--modes", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="profile_prefill")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    result = {}
    for mode in args.modes.split(","):
        result[mode] = profile(mode, args.tokens)
        say(f"{mode}: {result[mode]}")
    save(args.out, {"threads": args.threads, "tokens": args.tokens, "modes": result})


if __name__ == "__main__":
    main()
