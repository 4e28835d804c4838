"""Measured KV-cache bytes per token against 2 x layers x kv_heads x head_dim x dtype bytes.

Measured two ways: the bytes of the allocated cache tensors, and the growth of the process's
resident memory when a cache of that shape is allocated and touched (each dtype in a fresh
process, so freed pages of another run cannot hide the growth). Reports the capacity in tokens
for the budget.

    .venv/bin/python -m bench.kv_memory [--budget-mib 1024]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from bench.common import save, say


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def measure(dtype: str, budget_mib: int) -> dict:
    import torch

    from cachegw.backend import LLM

    llm = LLM(compile="off", dtype=dtype, quantization="none", kv_cache_bytes=budget_mib * 2**20)
    runner = llm.engine.runner
    spec, tokens = runner.spec, llm.engine.kv_cache_tokens
    tensor_bytes = sum(k.nbytes + v.nbytes for k, v in runner.kv_caches)
    shape, torch_dtype = runner.kv_caches[0][0].shape, runner.kv_caches[0][0].dtype
    before = rss_bytes()
    again = [torch.ones(shape, dtype=torch_dtype) for _ in range(2 * spec.num_layers)]  # every page touched
    grown = rss_bytes() - before
    del again
    bits = torch.finfo(torch_dtype).bits
    formula = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * bits // 8
    return {
        "dtype": dtype,
        "formula_bytes_per_token": formula,
        "tensor_bytes_per_token": tensor_bytes / tokens,
        "rss_bytes_per_token": round(grown / tokens, 1),
        "budget_mib": budget_mib,
        "capacity_tokens": tokens,
        "num_blocks": runner.num_blocks,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-mib", type=int, default=1024)
    ap.add_argument("--dtype", help="measure only this dtype and print JSON (used per subprocess)")
    args = ap.parse_args()
    if args.dtype:
        print(json.dumps(measure(args.dtype, args.budget_mib)))
        return
    rows = []
    for dtype in ("float32", "bfloat16"):
        cmd = [
            sys.executable,
            "-m",
            "bench.kv_memory",
            "--dtype",
            dtype,
            "--budget-mib",
            str(args.budget_mib),
        ]
        row = json.loads(
            subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.splitlines()[-1]
        )
        say(
            f"{dtype}: formula {row['formula_bytes_per_token']} B/token, "
            f"tensors {row['tensor_bytes_per_token']:.0f}, RSS {row['rss_bytes_per_token']:.0f}; "
            f"{row['capacity_tokens']} tokens"
        )
        rows.append(row)
    save("kv_memory", {"model": "SmolLM2-135M (30 layers, 3 KV heads, head_dim 64)", "rows": rows})


if __name__ == "__main__":
    main()
