"""Measured KV-cache bytes per token against 2 x layers x kv_heads x head_dim x dtype bytes.

Measured two ways: the bytes of the allocated cache tensors, and the growth of the process's
resident memory when the engine allocates them. Reports the capacity in tokens for the budget.

    .venv/bin/python -m bench.kv_memory  [--budget-mib 1024]
"""

from __future__ import annotations

import argparse

import torch

from bench.common import save, say


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-mib", type=int, default=1024)
    args = ap.parse_args()
    from backend import LLM
    from backend.model_runner import ModelRunner

    rows = []
    for dtype in ("float32", "bfloat16"):
        llm = LLM(dtype=dtype, kv_cache_bytes=args.budget_mib * 2**20)
        runner: ModelRunner = llm.engine.runner
        spec, tokens = runner.spec, llm.engine.kv_cache_tokens
        tensor_bytes = sum(k.nbytes + v.nbytes for k, v in runner.kv_caches)
        shape, torch_dtype = runner.kv_caches[0][0].shape, runner.kv_caches[0][0].dtype
        before = rss_bytes()
        again = [torch.ones(shape, dtype=torch_dtype) for _ in range(2 * spec.num_layers)]  # pages touched
        grown = rss_bytes() - before
        del again
        formula = (
            2
            * spec.num_layers
            * spec.num_kv_heads
            * spec.head_dim
            * torch.finfo(getattr(torch, dtype)).bits
            // 8
        )
        row = {
            "dtype": dtype,
            "formula_bytes_per_token": formula,
            "tensor_bytes_per_token": tensor_bytes / tokens,
            "rss_bytes_per_token": round(grown / tokens, 1),
            "budget_mib": args.budget_mib,
            "capacity_tokens": tokens,
            "num_blocks": runner.num_blocks,
        }
        say(
            f"{dtype}: formula {formula} B/token, tensors {row['tensor_bytes_per_token']:.0f}, "
            f"RSS {row['rss_bytes_per_token']:.0f}; {tokens} tokens"
        )
        rows.append(row)
        del llm
    save("kv_memory", {"model": "SmolLM2-135M (30 layers, 3 KV heads, head_dim 64)", "rows": rows})


if __name__ == "__main__":
    main()
