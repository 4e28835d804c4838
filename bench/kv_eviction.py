"""KV eviction at equal budgets: perplexity and decode speed of full attention, a sliding window,
StreamingLLM's sinks and H2O on long held-out texts, on the embedded SmolLM2 (float32).

Every mode scores the same tokens: each text's tokens past the first ``--budget`` (where the modes
begin to differ), as prompt logprobs, the text fed ``--chunk`` tokens a step.

- ``full``: every earlier token visible (the ceiling; the plain attention path).
- ``window``: ``kv_eviction = "h2o"`` with every kept token a recent one (``kv_recent_tokens`` =
  budget): a sliding window of the budget, keys at their true positions.
- ``sinks``: ``[engine] attention_sinks = 4`` with a context of the budget (StreamingLLM: the sinks
  and a window, exact per query, the sinks re-positioned just before the window).
- ``h2o``: half the budget the most recent tokens, half the heaviest hitters.
- ``h2o_sinks``: the same with 4 sink tokens always kept.

The eviction modes compact after each step, so between steps they hold the budget to budget + one
block, and a chunk's queries also see the chunk: about ``chunk + 16`` more than ``sinks`` sees.
Decode speed: ``--new`` tokens generated after a ``--tokens`` prompt, one request, per mode.

Usage: python -m bench.kv_eviction [--tokens 1024] [--texts 2] [--budget 256] [--chunk 16] [--new 64]
"""

from __future__ import annotations

import argparse
import math
import time

from bench.attention_sinks import scores, texts
from bench.common import save, say


def configure(llm, mode: str, budget: int) -> None:
    """Point the one H2O engine at a mode: its policy's sinks and recent window, or no eviction."""
    engine = llm.engine
    if not hasattr(engine, "_h2o_policy"):
        engine._h2o_policy = engine.h2o
    policy = engine._h2o_policy
    full = mode == "full"
    engine.runner.scores_keys = not full
    engine.h2o = None if full else policy
    policy.sinks = 4 if mode == "h2o_sinks" else 0
    policy.recent = budget if mode == "window" else (budget - policy.sinks) // 2


def decode_speed(llm, prompt: list[int], new: int) -> float:
    """Generated tokens per second after the first (the prompt's prefill excluded)."""
    from cachegw.backend import SamplingParams

    llm.engine.block_manager.reset_prefix_cache()
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True))[0]
    m = out.metrics
    return (len(out.outputs[0].token_ids) - 1) / (m.finish_time - m.first_token_time)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--texts", type=int, default=2)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--new", type=int, default=64)
    args = ap.parse_args()
    from cachegw.backend import LLM

    base = dict(
        dtype="float32", quantization="none", device="cpu", compile="off", kv_cache_tokens=4 * args.tokens
    )
    h2o = LLM(**base, max_num_batched_tokens=args.chunk, kv_eviction="h2o", kv_budget_tokens=args.budget)
    sinks = LLM(
        **base,
        max_num_batched_tokens=256,
        max_model_len=args.budget,
        attention_sinks=4,
        streaming_max_len=args.tokens + args.new + 1,
        enable_prefix_caching=False,
    )
    docs = texts(h2o.tokenizer, args.texts, args.tokens)
    say(f"{len(docs)} texts of {args.tokens} tokens, budget {args.budget}, chunk {args.chunk}")
    modes = ("full", "window", "sinks", "h2o", "h2o_sinks")
    logprobs: dict[str, list[float]] = {m: [] for m in modes}
    seconds = dict.fromkeys(modes, 0.0)
    speed: dict[str, list[float]] = {m: [] for m in modes}
    past = slice(args.budget - 1, None)  # logprobs of tokens budget, budget + 1, ...
    for i, doc in enumerate(docs):
        for mode in modes:
            llm = sinks if mode == "sinks" else h2o
            if llm is h2o:
                configure(h2o, mode, args.budget)
            t = time.perf_counter()
            logprobs[mode] += scores(llm, doc)[past]
            seconds[mode] += time.perf_counter() - t
            speed[mode].append(decode_speed(llm, doc, args.new))
        say(
            f"text {i + 1}: "
            + ", ".join(f"{m} {math.exp(-sum(v) / len(v)):.2f}" for m, v in logprobs.items())
        )
    result = {
        m: {
            "perplexity": round(math.exp(-sum(v) / len(v)), 3),
            "tokens_scored": len(v),
            "scoring_seconds": round(seconds[m], 1),
            "decode_tokens_per_s": round(sum(speed[m]) / len(speed[m]), 2),
        }
        for m, v in logprobs.items()
    }
    for m, r in result.items():
        say(f"{m:10s} {r}")
    save(
        "kv_eviction",
        {
            "command": f"python -m bench.kv_eviction --tokens {args.tokens} --texts {args.texts} "
            f"--budget {args.budget} --chunk {args.chunk} --new {args.new}",
            "model": "SmolLM2-135M-Instruct (embedded), float32, CPU",
            "texts": "ShareGPT dev conversations (turns joined), the first of >= tokens",
            "note": "2-core machine shared with other work; small sample (texts x tokens)",
            "budget_tokens": args.budget,
            "modes": result,
        },
    )


if __name__ == "__main__":
    main()
