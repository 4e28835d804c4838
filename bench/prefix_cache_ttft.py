"""Time to first token of a 2,000-token prompt: cold, against its first 1,984 tokens cached.

The peer is the same engine with nothing cached (a distinct cache salt makes every run cold),
and Hugging Face's forward pass over the whole prompt.

    .venv/bin/python -m bench.prefix_cache_ttft  [--repeats 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from bench.common import save, say

PROMPT, CACHED = 2000, 1984


def ttft(llm, prompt: list[int], salt: str) -> tuple[float, int]:
    from cachegw.backend import SamplingParams

    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1), cache_salt=salt)[0]
    return out.metrics.time_to_first_token, out.num_cached_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from cachegw.backend import LLM

    llm = LLM(compile="off", dtype=args.dtype, quantization="none", max_num_batched_tokens=2048)
    rng = random.Random(0)
    vocab = llm.engine.runner.spec.vocab_size
    cold, warm, hits = [], [], []
    for r in range(args.repeats):
        shared = [rng.randrange(100, vocab) for _ in range(CACHED)]
        prompt = shared + [rng.randrange(100, vocab) for _ in range(PROMPT - CACHED)]
        cold.append(ttft(llm, prompt, salt=f"cold-{r}")[0])
        ttft(llm, shared + [rng.randrange(100, vocab) for _ in range(PROMPT - CACHED)], salt=f"warm-{r}")
        t, hit = ttft(llm, prompt, salt=f"warm-{r}")
        warm.append(t)
        hits.append(hit)
        say(
            f"run {r + 1}/{args.repeats}: cold {cold[-1] * 1e3:.0f} ms, "
            f"cached {t * 1e3:.1f} ms ({hit} tokens hit)"
        )
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        str(llm.engine.model_dir), dtype=getattr(torch, args.dtype)
    ).eval()
    hf_times = []
    for _ in range(args.repeats):
        ids = torch.tensor([[rng.randrange(100, vocab) for _ in range(PROMPT)]])
        start = time.perf_counter()
        with torch.no_grad():
            hf(ids, logits_to_keep=1)
        hf_times.append(time.perf_counter() - start)
    c, w, h = statistics.median(cold), statistics.median(warm), statistics.median(hf_times)
    result = {
        "prompt_tokens": PROMPT,
        "cached_tokens": CACHED,
        "dtype": args.dtype,
        "repeats": args.repeats,
        "num_cached_tokens_seen": hits,
        "ttft_cold_ms": round(c * 1e3, 1),
        "ttft_cached_ms": round(w * 1e3, 2),
        "hf_forward_ms": round(h * 1e3, 1),
        "speedup_vs_cold": round(c / w, 1),
        "speedup_vs_hf": round(h / w, 1),
        "target": ">= 10x",
    }
    save("prefix_cache_ttft", result)
    print(f"TTFT cold {c * 1e3:.0f} ms | cached {w * 1e3:.1f} ms | HF {h * 1e3:.0f} ms | {c / w:.1f}x")


if __name__ == "__main__":
    main()
