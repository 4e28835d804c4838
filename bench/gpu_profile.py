"""GPU: where a batch-1 decode step of a Llama-3-8B-shaped model (dummy bf16 weights) spends its time.

Batch-1 decode runs at about 75% of the bandwidth bound on an H200 (docs/benchmarks.md, "GPU"); this
says where the rest goes, so the next loan of a GPU can go straight at it. The same engine is profiled
twice with torch.profiler over a run of decode steps: with CUDA graphs (as served) and eagerly. Each
GPU kernel's time is put in a group (the projections' matrix products, attention, the KV store, the
fused norms/rotary/SiLU, sampling, copies, the rest), per decode step, beside the step's wall time and
the bound (weight bytes / measured copy bandwidth). Kernel time well under the step's wall time means
the GPU waits on the host; kernel time near it means the kernels themselves are slow.

Needs CUDA; exits with a message and status 2 (and writes nothing) elsewhere.

    .venv/bin/python -m bench.gpu_profile [--steps 32] [--out results.json]
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

import torch

from bench.common import save, say
from bench.gpu_decode import llama3_folder, measured_bandwidth

# kernel name pattern -> group, first match wins (cuBLAS/cutlass names vary by GPU and version)
GROUPS: tuple[tuple[str, str], ...] = (
    ("attention", r"_attn_kernel|_merge_splits|flash|fmha|attention"),
    ("kv store", r"_store_kv"),
    ("fused norm/rotary/silu", r"_rms|_rotary|_rotate|_silu"),
    ("matmul", r"gemv|gemm|cutlass|cublas|sm\d+_xmma|Kernel2|splitK|nvjet"),
    ("sampling", r"(?i)argmax|topk|sort|softmax|multinomial|exponential|cumsum"),
    ("copy", r"[Mm]emcpy|[Mm]emset|copy|fill"),
)


def group_of(kernel: str) -> str:
    """The group a GPU kernel's name belongs to (``GROUPS``), "other" when none matches."""
    for group, pattern in GROUPS:
        if re.search(pattern, kernel):
            return group
    return "other"


def summarize(kernels: list[tuple[str, float]], steps: int, step_ms: float) -> dict:
    """(kernel name, total device microseconds) over ``steps`` decode steps: ms per step by group and
    the 15 costliest kernels, with the share of the step's wall time the GPU spent in kernels."""
    by_group: dict[str, float] = {}
    for name, us in kernels:
        by_group[group_of(name)] = by_group.get(group_of(name), 0.0) + us / 1000 / steps
    busy = sum(by_group.values())
    top = sorted(kernels, key=lambda k: -k[1])[:15]
    return {
        "step_ms": round(step_ms, 3),
        "kernel_ms_per_step": round(busy, 3),
        "gpu_busy_share": round(busy / step_ms, 3) if step_ms else None,
        "groups_ms_per_step": {g: round(ms, 3) for g, ms in sorted(by_group.items(), key=lambda i: -i[1])},
        "top_kernels": [{"kernel": n[:120], "ms_per_step": round(us / 1000 / steps, 4)} for n, us in top],
    }


def profile_decode(llm, steps: int) -> tuple[list[tuple[str, float]], float]:
    """Every GPU kernel's device time over ``steps`` decode steps of one 128-token prompt, and the
    decode's wall ms per step (measured on its own, without the profiler)."""
    from torch.profiler import ProfilerActivity, profile

    from cachegw.backend import SamplingParams

    prompt = [[1000 + i for i in range(128)]]
    warm = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    llm.generate(prompt, warm)  # warm-up: graphs, Triton compiles
    out = llm.generate(prompt, warm)[0]
    step_ms = (out.metrics.finish_time - out.metrics.first_token_time) * 1000 / (steps - 1)
    # a prompt already cached: almost all of the profiled kernels are decode steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompt, warm)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    kernels = [
        (evt.key, float(evt.self_device_time_total))
        for evt in prof.key_averages()
        if evt.device_type == torch.autograd.DeviceType.CUDA and evt.self_device_time_total > 0
    ]
    return kernels, step_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=32, help="decode steps profiled")
    ap.add_argument("--out", type=Path, default=None, help="JSON file (default: bench/results/)")
    args = ap.parse_args()
    tmp = llama3_folder()
    from cachegw.backend import LLM

    result: dict = {"model": "Llama-3-8B shape, dummy weights, bfloat16", "steps": args.steps}
    for mode, eager in (("graphs", False), ("eager", True)):
        t0 = time.perf_counter()
        llm = LLM(model=str(tmp), load_format="dummy", dtype="bfloat16", max_num_seqs=4, max_model_len=1024,
                  gpu_memory_utilization=0.3, enforce_eager=eager)  # fmt: skip
        if "bound_ms" not in result:
            weight_bytes = sum(p.nbytes for p in llm.engine.runner.model.parameters())
            result["bound_ms"] = round(weight_bytes / measured_bandwidth() * 1000, 3)
        kernels, step_ms = profile_decode(llm, args.steps)
        result[mode] = summarize(kernels, args.steps, step_ms)
        result[mode]["attention"] = llm.engine.runner.attention_backend
        say(f"{mode}: {step_ms:.2f} ms a step (bound {result['bound_ms']:.2f}), kernels "
            f"{result[mode]['kernel_ms_per_step']:.2f} ms: {result[mode]['groups_ms_per_step']} "
            f"({time.perf_counter() - t0:.0f} s)")  # fmt: skip
        del llm
        torch.cuda.empty_cache()
    save("gpu_profile", result, args.out)


if __name__ == "__main__":
    main()
