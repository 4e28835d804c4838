"""What StreamingLLM attention sinks cost in quality past the context, against truncation.

The embedded SmolLM2-135M scores fixed texts (ShareGPT conversations, one text each, cut to
``--tokens``) with a pretend context of ``--context`` tokens: every mode predicts the same tokens,
those past the context, and the figure is their perplexity.

- ``full``: the whole text visible (the model's real context is 8192): the ceiling.
- ``sinks``: ``[engine] attention_sinks`` (the first N tokens plus a window filling the context).
- ``window``: the same window without sinks (its true positions, nothing before it).
- ``truncate_half``: truncation with recomputation: each token sees the last context/2..context
  tokens, a fresh prefill per half context (twice the compute of a prefill of the text).
- ``restart``: the text cut into context-sized pieces scored on their own (what dropping the
  history at each overflow gives: on average half a context seen).

Usage: python -m bench.attention_sinks [--context 256] [--tokens 768] [--texts 2] [--sinks 4]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

from bench.common import SHARED_DATA, save, say


def texts(tokenizer, count: int, tokens: int) -> list[list[int]]:
    """The first ``count`` ShareGPT conversations of at least ``tokens`` tokens, as one text each."""
    out = []
    with open(SHARED_DATA / "sharegpt_dev.jsonl") as f:
        for line in f:
            turns = json.loads(line)["conversations"]
            ids = tokenizer("\n\n".join(t["value"] for t in turns))["input_ids"]
            if len(ids) >= tokens:
                out.append(ids[:tokens])
                if len(out) == count:
                    break
    return out


def scores(llm, prompt: list[int]) -> list[float]:
    """Logprob of each prompt token after the first (echo scoring)."""
    from cachegw.backend import SamplingParams

    out = llm.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=0, echo=True))[0]
    return [d["logprob"] for d in out.prompt_logprobs[1:]]


def set_window(llm, window: int | None) -> None:
    for layer in llm.engine.runner.model.layers:
        layer.self_attn.attn.sliding_window = window


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=768)
    ap.add_argument("--texts", type=int, default=2)
    ap.add_argument("--sinks", type=int, default=4)
    args = ap.parse_args()
    from cachegw.backend import LLM

    ctx = args.context
    base = dict(
        dtype="float32",
        quantization="none",
        device="cpu",
        kv_cache_tokens=4 * args.tokens,
        enable_prefix_caching=False,
    )
    full = LLM(compile="off", **base)
    sinks = LLM(
        compile="off",
        **base,
        max_model_len=ctx,
        attention_sinks=args.sinks,
        streaming_max_len=args.tokens + 1,
    )
    docs = texts(full.tokenizer, args.texts, args.tokens)
    say(f"{len(docs)} texts of {args.tokens} tokens, context {ctx}, {args.sinks} sinks")
    per_mode: dict[str, list[float]] = {
        m: [] for m in ("full", "sinks", "window", "truncate_half", "restart")
    }
    seconds: dict[str, float] = dict.fromkeys(per_mode, 0.0)
    past = slice(ctx - 1, None)  # logprobs of tokens ctx, ctx + 1, ...: past the context
    for i, doc in enumerate(docs):
        t = time.perf_counter()
        per_mode["full"] += scores(full, doc)[past]
        seconds["full"] += time.perf_counter() - t
        t = time.perf_counter()
        per_mode["sinks"] += scores(sinks, doc)[past]
        seconds["sinks"] += time.perf_counter() - t
        t = time.perf_counter()
        set_window(full, ctx)
        per_mode["window"] += scores(full, doc)[past]
        set_window(full, None)
        seconds["window"] += time.perf_counter() - t
        t = time.perf_counter()
        half, got = ctx // 2, []
        for end in range(ctx, len(doc) + half, half):  # each piece scores its last half
            piece = doc[max(0, min(end, len(doc)) - ctx) : min(end, len(doc))]
            new = min(end, len(doc)) - max(ctx, end - half)
            if new > 0:
                got += scores(full, piece)[-new:]
        per_mode["truncate_half"] += got
        seconds["truncate_half"] += time.perf_counter() - t
        t = time.perf_counter()
        for start in range(ctx, len(doc), ctx - 1):  # a piece of ctx tokens scores ctx - 1 of them
            per_mode["restart"] += scores(full, doc[start - 1 : start - 1 + ctx])
        seconds["restart"] += time.perf_counter() - t
        say(
            f"text {i + 1}: "
            + ", ".join(f"{m} {math.exp(-sum(v) / len(v)):.2f}" for m, v in per_mode.items())
        )
    result = {
        m: {
            "perplexity": round(math.exp(-sum(v) / len(v)), 3),
            "tokens": len(v),
            "seconds": round(seconds[m], 1),
        }
        for m, v in per_mode.items()
    }
    for m, r in result.items():
        say(f"{m:14s} perplexity {r['perplexity']:.3f} over {r['tokens']} tokens, {r['seconds']} s")
    load = os.getloadavg()
    save(
        "swa",
        {
            "command": f"python -m bench.attention_sinks --context {ctx} --tokens {args.tokens} "
            f"--texts {args.texts} --sinks {args.sinks}",
            "model": "SmolLM2-135M-Instruct (embedded), float32",
            "texts": "ShareGPT dev conversations (turns joined), the first of >= tokens",
            "context": ctx,
            "sinks": args.sinks,
            "tokens_per_text": args.tokens,
            "load_avg_1_5_15": [round(x, 2) for x in load],
            "modes": result,
        },
    )


if __name__ == "__main__":
    main()
