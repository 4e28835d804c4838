"""GPU parity: the engine's greedy tokens against Hugging Face's on one small random Llama.

A Llama-shaped model with seeded random weights is made by transformers and saved as safetensors
(no model file has to travel to the GPU machine), then run by our engine and by Hugging Face on the
same device:

1. float32 and bfloat16: greedy tokens per prompt, ours against HF's (float32 must match exactly;
   bfloat16 is reported, since the two sum in different orders), and the largest log-probability
   difference on the steps before the first differing token.
2. ``kv_cache_dtype="fp8"`` and ``"int8"``: the share of tokens that match the bfloat16 cache's, and
   the largest log-probability difference before they part (int8 shows what a finer format costs).
3. CUDA-graph decode (the default) against ``enforce_eager=True``: identical tokens in float32. In
   bfloat16 it is reported only: a graph is captured for the longest context, so its decode may split
   the KV range differently from an eager step's (``kv_splits.py``) and sum in another order.

Exits 1 when float32 tokens differ (ours against HF's, or graphs against eager), or when CUDA runs
without the Triton kernels or without graphs. ``--device cpu --tiny`` runs the same code in seconds
(tests/test_gpu_parity.py).

    python -m bench.gpu_parity [--device cuda] [--out results.json] [--tiny]
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.common import save, say
from testkit.random_llama import LlamaShape, save_random_llama

TOP_K = 5  # logprobs the engine returns per step (its limit is 20)


@dataclass(frozen=True)
class Sizes:
    model: LlamaShape
    prompt_lens: tuple[int, ...]
    new_tokens: int


# Prompts cross several 16-token KV blocks (and the decode kernel's KV splits) and mix short with long.
GPU = Sizes(LlamaShape(1024, 4, 16, 4, 64, 2816, 8192), (3, 17, 40, 64, 129, 200, 257, 333), 48)
TINY = Sizes(LlamaShape(64, 2, 4, 2, 32, 128, 512), (3, 20, 37), 8)


@dataclass
class Run:
    """One engine's or HF's greedy answer: tokens per prompt and, per step, token -> logprob."""

    tokens: list[list[int]]
    logprobs: list[list[dict[int, float]]]
    attention: str = "hf"
    graphs: int = 0


def make_prompts(sizes: Sizes, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, sizes.model.vocab) for _ in range(n)] for n in sizes.prompt_lens]


def ours(model_dir: Path, device: str, dtype: str, prompts: list[list[int]], new_tokens: int, **kw) -> Run:
    from cachegw.backend import LLM, SamplingParams

    llm = LLM(model=str(model_dir), device=device, dtype=dtype, quantization="none", compile="off",
              kv_cache_tokens=8192, max_num_seqs=len(prompts), max_model_len=1024, **kw)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, logprobs=TOP_K)
    outs = [o.outputs[0] for o in llm.generate(prompts, params)]
    runner = llm.engine.runner
    run = Run(
        tokens=[list(o.token_ids) for o in outs],
        logprobs=[[dict(e["top"]) | {e["token_id"]: e["logprob"]} for e in o.logprobs or []] for o in outs],
        attention=runner.attention_backend + ("+fused" if runner.fused_elementwise else ""),
        graphs=len(runner.graphs or ()),
    )
    del llm, runner
    free_memory()
    return run


def hf(model_dir: Path, device: str, dtype: str, prompts: list[list[int]], new_tokens: int) -> Run:
    """Greedy decoding by full forward passes (no cache to get wrong), every logprob kept."""
    from transformers import AutoModelForCausalLM

    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
    model = model.to(device).eval()
    tokens, logprobs = [], []
    with torch.inference_mode():
        for prompt in prompts:
            ids, steps = list(prompt), []
            for _ in range(new_tokens):
                logits = model(torch.tensor([ids], device=device)).logits[0, -1].float()
                lp = torch.log_softmax(logits, -1).cpu()
                steps.append(dict(enumerate(lp.tolist())))
                ids.append(int(lp.argmax()))
            tokens.append(ids[len(prompt) :])
            logprobs.append(steps)
    del model
    free_memory()
    return Run(tokens, logprobs)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def compare(a: Run, b: Run) -> dict:
    """Per prompt: equal, the first differing step, the share of equal positions; and the largest
    |logprob| difference over tokens both sides list, on steps whose inputs were still the same."""
    per_prompt: list[dict] = []
    shares: list[float] = []
    max_diff = 0.0
    for ta, tb, la, lb in zip(a.tokens, b.tokens, a.logprobs, b.logprobs, strict=True):
        first = first_difference(ta, tb)
        same = sum(x == y for x, y in zip(ta, tb, strict=True))
        shares.append(round(same / len(ta), 4))
        per_prompt.append({"equal": first is None, "first_difference": first, "share": shares[-1]})
        for step in range(len(ta) if first is None else first + 1):  # the differing step's inputs agree too
            shared = la[step].keys() & lb[step].keys()
            max_diff = max([max_diff, *(abs(la[step][t] - lb[step][t]) for t in shared)])
    return {
        "all_equal": all(p["equal"] for p in per_prompt),
        "share": round(sum(shares) / len(shares), 4),
        "max_logprob_difference": float(f"{max_diff:.3g}"),
        "per_prompt": per_prompt,
    }


def check(device: str, sizes: Sizes, seed: int = 0) -> dict:
    """Every comparison of the module docstring, as one JSON-ready payload with pass flags."""
    prompts, new_tokens = make_prompts(sizes, seed), sizes.new_tokens
    with tempfile.TemporaryDirectory(prefix="cachegw-parity-") as tmp:
        model_dir = save_random_llama(Path(tmp), sizes.model, seed)

        def engine(dtype: str, **kw) -> Run:
            say(f"engine {dtype} {kw or ''}")
            return ours(model_dir, device, dtype, prompts, new_tokens, **kw)

        runs = {
            "ours_float32": engine("float32"),
            "ours_bfloat16": engine("bfloat16"),
            "ours_bfloat16_fp8_kv": engine("bfloat16", kv_cache_dtype="fp8"),
            "ours_bfloat16_int8_kv": engine("bfloat16", kv_cache_dtype="int8"),
            "ours_float32_eager": engine("float32", enforce_eager=True),
            "ours_bfloat16_eager": engine("bfloat16", enforce_eager=True),
        }
        say("Hugging Face float32 and bfloat16")
        runs["hf_float32"] = hf(model_dir, device, "float32", prompts, new_tokens)
        runs["hf_bfloat16"] = hf(model_dir, device, "bfloat16", prompts, new_tokens)
    results = {
        "float32_vs_hf": compare(runs["ours_float32"], runs["hf_float32"]),
        "bfloat16_vs_hf": compare(runs["ours_bfloat16"], runs["hf_bfloat16"]),
        "fp8_kv_vs_bfloat16": compare(runs["ours_bfloat16_fp8_kv"], runs["ours_bfloat16"]),
        "int8_kv_vs_bfloat16": compare(runs["ours_bfloat16_int8_kv"], runs["ours_bfloat16"]),
        "graphs_vs_eager_float32": compare(runs["ours_float32"], runs["ours_float32_eager"]),
        "graphs_vs_eager": compare(runs["ours_bfloat16"], runs["ours_bfloat16_eager"]),
    }
    on_cuda = device.startswith("cuda")
    engines: dict[str, dict] = {
        name: {"attention": r.attention, "cuda_graphs": r.graphs}
        for name, r in runs.items()
        if name.startswith("ours")
    }
    passed = {
        "float32_equal": results["float32_vs_hf"]["all_equal"],
        "graphs_equal_eager": results["graphs_vs_eager_float32"]["all_equal"],
        # on CUDA the kernels and graphs must really run (the engine falls back silently otherwise)
        "triton_used": not on_cuda or all(e["attention"].startswith("triton") for e in engines.values()),
        "graphs_captured": not on_cuda or runs["ours_bfloat16"].graphs > 0,
    }
    return {
        "sizes": asdict(sizes),
        "device": device,
        "seed": seed,
        "engines": engines,
        **results,
        "passed": passed,
        "ok": all(passed.values()),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="the CPU test's sizes (seconds on a CPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="JSON file (default: bench/results/)")
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        say("no CUDA device: use --device cpu (with --tiny) off a GPU machine; nothing written")
        return 2
    payload = check(args.device, TINY if args.tiny else GPU, args.seed)
    for name in (
        "float32_vs_hf",
        "bfloat16_vs_hf",
        "fp8_kv_vs_bfloat16",
        "int8_kv_vs_bfloat16",
        "graphs_vs_eager_float32",
        "graphs_vs_eager",
    ):
        r = payload[name]
        diff = r["max_logprob_difference"]
        say(f"{name}: all equal {r['all_equal']}, share {r['share']}, max logprob difference {diff}")
    say(f"passed: {payload['passed']}")
    save("gpu_parity", payload, args.out)
    return 0 if payload["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
