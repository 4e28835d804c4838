"""Four LoRA adapters served together against the base model alone: output tokens/s at 16 concurrent
requests, and the prefix-cache hit rate of each adapter.

SmolLM2-135M (the embedded GGUF, the default int4 weights) in one engine with ``max_loras = 4``; the
four adapters are made here with PEFT at rank 16 on every projection, their matrices random (small,
so the output stays the model's kind of text; speed does not depend on the values). Each round sends
16 requests at once, each a 256-token shared prefix (a system prompt) plus 32 tokens of its own, 32
output tokens (``ignore_eos``). The modes, interleaved round by round so that the shared machine's
load falls on all alike:

- ``base``: the 16 requests on the base model, with the compiled decode step (``[engine] compile``);
- ``base-eager``: the same with the compiled step set aside: what every step with an adapter runs;
- ``lora``: 4 requests under each of the 4 adapters, in the same batches.

``lora / base`` is what serving adapters costs a user; ``lora / base-eager`` is the LoRA matmuls' own
share. Every adapter computes the shared prefix for itself (its blocks are keyed by the adapter); the
hit rate per adapter is over each round's prompt tokens; tokens/s are medians over the rounds after
the first (which computes the prefix cold).

    .venv/bin/python -m bench.lora_throughput [--rounds 3] [--threads 2] [--compile startup]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import save, say

ADAPTERS = ("a0", "a1", "a2", "a3")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PREFIX, OWN, OUT, CONCURRENCY = 256, 32, 32, 16


def make_adapters(model_dir: Path, folder: Path, rank: int) -> dict[str, str]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    paths = {}
    for i, name in enumerate(ADAPTERS):
        torch.manual_seed(i)
        peft_model = get_peft_model(
            base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False)
        )
        with torch.no_grad():
            for pname, p in peft_model.named_parameters():
                if "lora_B" in pname:
                    p.mul_(0.01)
        peft_model.save_pretrained(str(folder / name))
        base = peft_model.unload()
        paths[name] = str(folder / name)
    return paths


def run_round(llm, mode: str, prompts: list[list[int]]) -> dict:
    from dataclasses import replace

    from cachegw.backend import SamplingParams

    runner = llm.engine.runner
    params = SamplingParams(temperature=0.0, max_tokens=OUT, ignore_eos=True)
    names = [None] * len(prompts) if mode != "lora" else [ADAPTERS[i % 4] for i in range(len(prompts))]
    plist = [replace(params, lora=llm.lora(n) if n else None) for n in names]
    compiled = runner.compiled
    if mode == "base-eager":
        runner.compiled = None
    start = time.perf_counter()
    try:
        outs = llm.generate(prompts, plist)
    finally:
        runner.compiled = compiled
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    hits: dict[str, list[int]] = {}
    for name, o in zip(names, outs, strict=True):
        h = hits.setdefault(name or "base", [0, 0])
        h[0] += o.num_cached_tokens
        h[1] += len(o.prompt_token_ids)
    return {
        "seconds": round(seconds, 2),
        "tokens_per_s": round(tokens / seconds, 1),
        "prefix_hit_rate": {k: round(v[0] / v[1], 3) for k, v in hits.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--compile", default="startup", help="[engine] compile for the run (startup | off)")
    ap.add_argument("--out", default="lora_throughput")
    args = ap.parse_args()
    if args.threads > 1:  # before torch starts: spinning threads collapse beside other work
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    torch.set_num_threads(args.threads)
    from cachegw.backend import LLM
    from cachegw.backend.config import load_engine_config
    from cachegw.backend.executor.model_loader import resolve_model_dir

    cfg = load_engine_config(None)
    model_dir = resolve_model_dir(cfg.model, cfg.resolved_cache_dir)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = make_adapters(model_dir, Path(tmp), args.rank)
        say("adapters made; loading the engine (compiling the decode step)")
        start = time.perf_counter()
        llm = LLM(
            compile=args.compile, max_loras=4, max_lora_rank=args.rank, lora_modules=adapters,
            kv_cache_tokens=32768, max_num_seqs=CONCURRENCY,
        )  # fmt: skip
        ready_s = time.perf_counter() - start
    runner = llm.engine.runner
    rng = random.Random(0)
    prefix = [rng.randrange(100, 49152) for _ in range(PREFIX)]
    modes = ("base", "base-eager", "lora")
    rounds: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode in modes:
            prompts = [prefix + [rng.randrange(100, 49152) for _ in range(OWN)] for _ in range(CONCURRENCY)]
            result = run_round(llm, mode, prompts)
            rounds[mode].append(result)
            say(f"round {r} {mode}: {result}")
    warm = slice(1, None) if args.rounds > 1 else slice(None)  # round 0: the prefix computed cold
    median = {m: statistics.median(x["tokens_per_s"] for x in rounds[m][warm]) for m in modes}
    save(
        args.out,
        {
            "model": "SmolLM2-135M-Instruct (embedded GGUF)",
            "weights": runner.quantization,
            "compiled_decode": bool(runner.compiled and runner.compiled.ready),
            "compiled_steps": runner.compiled.steps if runner.compiled else 0,
            "engine_ready_s": round(ready_s, 1),
            "adapters": {
                "count": 4,
                "rank": args.rank,
                "targets": TARGETS,
                "slot_mib": round(runner.loras.bytes_per_slot / 2**20, 1),
            },  # type: ignore[union-attr]
            "workload": {"concurrency": CONCURRENCY, "prefix": PREFIX, "own": OWN, "output": OUT},
            "tokens_per_s_median": median,
            "ratios": {
                "lora/base": round(median["lora"] / median["base"], 3),
                "lora/base-eager": round(median["lora"] / median["base-eager"], 3),
                "base-eager/base": round(median["base-eager"] / median["base"], 3),
            },
            "rounds": rounds,
            "note": "2-core machine shared with other work; modes interleaved round by round",
        },
    )


if __name__ == "__main__":
    main()
