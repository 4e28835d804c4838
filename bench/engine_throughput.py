"""Output tokens/s of our engine against Hugging Face `generate` in static batches, one run.

64 requests, prompt lengths 64-512 and output lengths 16-256 (ignore_eos), SmolLM2 float32.
HF runs them in static batches of 16: a batch lasts as long as its longest output, and only each
request's own output tokens count as useful (as a client would see them).

    .venv/bin/python -m bench.engine_throughput  [--requests 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from bench.common import save, say


def workload(n: int, seed: int, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(100, vocab) for _ in range(rng.randint(64, 512))], rng.randint(16, 256))
        for _ in range(n)
    ]


def run_ours(llm, work) -> float:
    from backend import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in work]
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in work], params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outs] == [m for _, m in work]
    return elapsed


def run_hf(model, work, batch: int, pad_id: int) -> float:
    start = time.perf_counter()
    for b in range(0, len(work), batch):
        chunk = work[b : b + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, (p, _) in enumerate(chunk):  # left padding, as decoder-only generate needs
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        longest = max(m for _, m in chunk)
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=pad_id,
            )
        say(f"HF batch {b // batch + 1}/{-(-len(work) // batch)} done ({time.perf_counter() - start:.0f} s)")
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from backend import LLM

    say("loading our engine (SmolLM2-135M, float32)")
    llm = LLM(dtype="float32")
    work = workload(args.requests, args.seed, llm.engine.runner.spec.vocab_size)
    useful = sum(m for _, m in work)
    say(f"{len(work)} requests, {sum(len(p) for p, _ in work)} prompt tokens, {useful} output tokens")
    ours = run_ours(llm, work)
    say(f"ours: {ours:.1f} s, {useful / ours:.1f} tok/s")
    hf = AutoModelForCausalLM.from_pretrained(str(llm.engine.model_dir), dtype=torch.float32).eval()
    del llm
    hf_s = run_hf(hf, work, args.hf_batch, pad_id=0)
    say(f"HF generate: {hf_s:.1f} s, {useful / hf_s:.1f} tok/s")
    result = {
        "workload": {
            "requests": len(work),
            "prompt_len": [64, 512],
            "output_len": [16, 256],
            "seed": args.seed,
            "output_tokens": useful,
            "hf_static_batch": args.hf_batch,
            "dtype": "float32",
        },
        "ours": {"seconds": round(ours, 2), "output_tok_per_s": round(useful / ours, 1)},
        "hf_generate": {"seconds": round(hf_s, 2), "output_tok_per_s": round(useful / hf_s, 1)},
        "speedup": round(hf_s / ours, 2),
        "target": ">= 2.0",
    }
    save("engine_throughput", result)
    print(
        f"ours {useful / ours:.1f} tok/s | HF generate {useful / hf_s:.1f} tok/s | ratio {hf_s / ours:.2f}x"
    )


if __name__ == "__main__":
    main()
