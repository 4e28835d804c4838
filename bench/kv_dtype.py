"""What an int8 or fp8 KV cache (``[engine] kv_cache_dtype``) costs and gives, on the embedded SmolLM2.

``accuracy``: for each weight mode (float32, int4), each KV dtype against the float32-KV engine with the
same weights: greedy agreement over the first human turn of 64 ShareGPT conversations (128 new tokens,
ignore_eos; bench/quant_accuracy.py's prompts and measures) and teacher-forced perplexity on
quant_accuracy's 16 texts. The chat prompts are prefilled in one chunk each (as served: a prompt
attends to its own K/V, every decode reads the cache as stored); the perplexity runs through the
engine's prompt logprobs with 64-token prefill chunks, so every position past the first chunk attends
to the cache as stored (a one-chunk prefill attends to its own unquantized K/V: no KV dtype shows).

``speed``: KV capacity in tokens per GiB (the engine's own sizing for a 256 MiB budget, x4) and
batch-1 decode tokens/s at a 4,096-token context in each KV dtype: the engines side by side in one
process, runs interleaved (the machine is shared: compare the ratios, not the absolute figures).

    .venv/bin/python -m bench.kv_dtype accuracy [--weights none,int4] [--kv int8,fp8] [--prompts 64]
(the float32-KV reference of each weight mode is computed once and kept in ~/.cache/cachegw/bench/, so
``--kv ""`` then ``--kv int8`` and ``--kv fp8`` are three short runs)
    .venv/bin/python -m bench.kv_dtype speed [--quantization auto] [--context 4096] [--new 64]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import time
from pathlib import Path

import torch

from bench.common import RESULTS, SHARED_DATA, save, say
from bench.quant_accuracy import _agreement, _conversations

KV_DTYPES = ("auto", "int8", "fp8")
REF_DIR = Path.home() / ".cache" / "cachegw" / "bench"
CHUNK = 64  # prefill chunk of the perplexity pass


def _engine(weights: str, kv: str, **kw):
    """``kv``: a kv_cache_dtype, or one with "-unfused" after it (the fused decode step off: every
    decode on the eager modules and torch's attention, as an int8 cache ran before the step read it)."""
    from cachegw.backend import LLM

    if kv.endswith("-unfused"):
        kw["fused_decode"] = False
    kind = kv.removesuffix("-unfused")
    return LLM(compile="off", quantization=weights, dtype="float32", kv_cache_dtype=kind, **kw)


def _perplexity(llm, texts: list[str], max_len: int) -> float:
    """Teacher-forced, from the engine's prompt logprobs (prefilled in CHUNK-token steps)."""
    from cachegw.backend import SamplingParams

    prompts = [llm.tokenizer.encode(t, add_special_tokens=False)[:max_len] for t in texts]
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0))
    scored = [e["logprob"] for o in outs for e in (o.prompt_logprobs or []) if e is not None]
    return math.exp(-sum(scored) / len(scored))


def _accuracy_run(weights: str, kv: str, prompts, texts, tokens: int) -> tuple[list[list[int]], float, float]:
    from cachegw.backend import SamplingParams

    llm = _engine(weights, kv, kv_cache_tokens=65536, max_num_seqs=64, enable_prefix_caching=False)
    start = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    outs = [
        list(o.outputs[0].token_ids)
        for o in llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    ]
    llm.engine.scheduler.max_num_batched_tokens = CHUNK  # the perplexity pass only (bench-only knob)
    ppl = _perplexity(llm, texts, 256)
    seconds = time.perf_counter() - start
    del llm
    gc.collect()
    return outs, ppl, seconds


def accuracy(args: argparse.Namespace) -> None:
    prompts, texts = _conversations(args.prompts, args.texts)
    path = RESULTS / "kv_dtype_accuracy.json"
    modes = json.loads(path.read_text())["weights"] if path.exists() else {}
    for weights in args.weights.split(","):
        # The float32-KV reference is kept between runs, so that each run (one engine) stays short.
        ref_file = REF_DIR / f"kv_dtype_ref_{weights}_{len(prompts)}x{args.tokens}.json"
        if ref_file.exists():
            ref, ref_ppl = json.loads(ref_file.read_text())
        else:
            ref, ref_ppl, secs = _accuracy_run(weights, "auto", prompts, texts, args.tokens)
            say(f"weights {weights}, kv auto (float32): perplexity {ref_ppl:.3f} ({secs:.0f} s)")
            REF_DIR.mkdir(parents=True, exist_ok=True)
            ref_file.write_text(json.dumps([ref, ref_ppl]))
        rows = modes.setdefault(weights, {})
        rows["auto"] = {"perplexity": round(ref_ppl, 3)}
        for kv in [k for k in args.kv.split(",") if k]:
            got, ppl, secs = _accuracy_run(weights, kv, prompts, texts, args.tokens)
            rows[kv] = {"perplexity": round(ppl, 3), **_agreement(ref, got)}
            say(f"weights {weights}, kv {kv}: {rows[kv]} ({secs:.0f} s)")
    save(
        "kv_dtype_accuracy",
        {
            "command": "python -m bench.kv_dtype accuracy",
            "prompts": len(prompts),
            "new_tokens": args.tokens,
            "ppl_texts": len(texts),
            "ppl_prefill_chunk": CHUNK,
            "reference": "the same weights with kv_cache_dtype = auto (float32)",
            "weights": modes,
        },
    )


def _long_prompt(tokenizer, n: int) -> list[int]:
    """``n`` tokens of ShareGPT answers, one after another."""
    ids: list[int] = []
    with open(SHARED_DATA / "sharegpt_dev.jsonl") as f:
        for line in f:
            for turn in json.loads(line)["conversations"]:
                if turn["from"] == "gpt":
                    ids += tokenizer.encode(turn["value"] + "\n\n", add_special_tokens=False)
            if len(ids) >= n:
                return ids[:n]
    raise SystemExit("not enough text for the context")


def speed(args: argparse.Namespace) -> None:
    from cachegw.backend import SamplingParams

    budget = 256 * 2**20
    engines = {
        kv: _engine(args.quantization, kv, kv_cache_bytes=budget, max_num_seqs=1) for kv in args.kv.split(",")
    }
    first = next(iter(engines.values()))
    prompt = _long_prompt(first.tokenizer, args.context)
    params = SamplingParams(temperature=0.0, max_tokens=args.new, ignore_eos=True)
    rows: dict[str, dict] = {}
    for kv, llm in engines.items():
        start = time.perf_counter()
        llm.generate(
            [prompt], SamplingParams(temperature=0.0, max_tokens=1)
        )  # prefill once: the prefix cache keeps it
        rows[kv] = {
            "bytes_per_token": llm.engine.runner.kv_bytes_per_token,
            "capacity_tokens_per_gib": llm.engine.kv_cache_tokens * (2**30 // budget),
            "prefill_seconds": round(time.perf_counter() - start, 1),
            "decode_tok_s": [],
        }
        say(
            f"{kv}: {rows[kv]['capacity_tokens_per_gib']} tokens/GiB, prefill {rows[kv]['prefill_seconds']} s"
        )
    for r in range(args.rounds):
        for kv, llm in engines.items():
            start = time.perf_counter()
            out = llm.generate([prompt], params)[0]
            assert out.num_cached_tokens >= args.context - llm.engine.config.block_size
            rows[kv]["decode_tok_s"].append(round(args.new / (time.perf_counter() - start), 2))
        say(f"round {r + 1}: " + ", ".join(f"{kv} {row['decode_tok_s'][-1]}" for kv, row in rows.items()))
        _save_speed(args, rows, r + 1)  # after every round: a shared machine may cut the run short


def _save_speed(args: argparse.Namespace, rows: dict[str, dict], rounds: int) -> None:
    base = statistics.median(rows["auto"]["decode_tok_s"]) if "auto" in rows else None
    for row in rows.values():
        row["decode_tok_s_median"] = statistics.median(row["decode_tok_s"])
        if base:
            row["decode_vs_auto"] = round(row["decode_tok_s_median"] / base, 3)
    save(
        "kv_dtype",
        {
            "command": f"python -m bench.kv_dtype speed --context {args.context} --new {args.new} "
            f"--rounds {args.rounds} --kv {args.kv}",
            "weights": args.quantization,
            "compute_dtype": "float32",
            "context_tokens": args.context,
            "new_tokens": args.new,
            "rounds": rounds,
            "kv_dtypes": rows,
        },
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    acc = sub.add_parser("accuracy")
    acc.add_argument("--weights", default="none,int4")
    acc.add_argument("--kv", default="int8,fp8")
    acc.add_argument("--prompts", type=int, default=64)
    acc.add_argument("--tokens", type=int, default=128)
    acc.add_argument("--texts", type=int, default=16)
    spd = sub.add_parser("speed")
    spd.add_argument("--quantization", default="auto")
    spd.add_argument("--kv", default=",".join(KV_DTYPES), help='e.g. "auto,int8,int8-unfused,fp8"')
    spd.add_argument("--context", type=int, default=4096)
    spd.add_argument("--new", type=int, default=64)
    spd.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    say(f"load average {os.getloadavg()}")
    accuracy(args) if args.what == "accuracy" else speed(args)


if __name__ == "__main__":
    main()
