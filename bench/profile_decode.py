"""Where a batch-1 decode step goes: torch.profiler over 20 engine steps after a 200-token prompt.

Operator self-times are put in groups: projections (float or int4/int8 matmuls, LM head
included), attention (SDPA or the compiled step's two matmuls, plus the KV-cache gather and store),
the other tensor ops (norms, rotary, SiLU, adds, copies, sampling; in a compiled step, the generated
C++ loops that fuse them), and what no operator accounts for (Python: scheduler, batch preparation,
module calls, detokenization, the compiled graph's guards).

    .venv/bin/python -m bench.profile_decode [--modes none,int4,int4+compile] [--steps 20] [--threads 2]
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from bench.common import save, say

_GROUPS = {
    "projections": (
        "aten::addmm",
        "aten::mm",
        "aten::_weight_int4pack_mm_for_cpu",
        "aten::_weight_int8pack_mm",
        "::block_linear",  # cachegw_<build>::block_linear
    ),
    "attention": (
        "scaled_dot_product",
        "flash_attention",
        "aten::index_select",
        "aten::index_put",
        "aten::bmm",
        "::paged_decode_attention",
    ),
    "other ops": ("CompiledFxGraph",),
}


def _group(name: str) -> str:
    return next((g for g, keys in _GROUPS.items() if any(k in name for k in keys)), "other ops")


def profile(mode: str, steps: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from cachegw.backend import LLM, SamplingParams

    weights, *flags = mode.split("+")  # "int4+compile+torch": compiled decode step, torch's kernels
    llm = LLM(
        quantization=weights,
        cpu_kernels="torch" if "torch" in flags else "auto",
        dtype="float32",
        kv_cache_tokens=1024,
        max_num_seqs=1,
        enable_prefix_caching=False,
        compile="startup" if "compile" in flags else "off",
    )
    engine = llm.engine
    engine.add_request(
        "p", list(range(100, 300)), SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    )
    for _ in range(4):  # the prefill and a few warm decode steps
        engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = (time.perf_counter() - start) / steps * 1000
    totals: dict[str, float] = {"projections": 0.0, "attention": 0.0, "other ops": 0.0}
    ops = 0
    events = sorted(prof.key_averages(), key=lambda ev: -ev.self_cpu_time_total)
    for ev in events:
        totals[_group(ev.key)] += ev.self_cpu_time_total / 1000 / steps
        ops += ev.count
    top = {ev.key: round(ev.self_cpu_time_total / 1000 / steps, 3) for ev in events[:8]}
    del llm, engine
    gc.collect()
    ms = {k: round(v, 2) for k, v in totals.items()}
    ms["outside operators"] = round(wall - sum(totals.values()), 2)
    return {
        "step_ms": round(wall, 2),
        "ms_per_step": ms,
        "operator_calls_per_step": round(ops / steps),
        "top_operators_ms_per_step": top,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="none,int4,int4+compile")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    result = {}
    for mode in args.modes.split(","):
        result[mode] = profile(mode, args.steps)
        say(f"{mode}: {result[mode]}")
    save("profile_decode", {"threads": args.threads, "steps": args.steps, "modes": result})


if __name__ == "__main__":
    main()
