"""GPU: decode speed of a Llama-3-8B-shaped model (dummy bf16 weights) against the memory bound.

1. Batch-1 decode tokens/s as a fraction of the bandwidth limit: every decode step reads all
   weights once, so the limit is HBM bandwidth / weight bytes. Bandwidth is measured here with a
   large device-to-device copy (the achievable figure, below the datasheet's).
2. Throughput at each concurrency (64 by default) against Hugging Face `generate` (one static batch
   of that many, its best case) on the same GPU, side by side in one run. One engine (sized for the
   largest concurrency) and one HF model serve every concurrency given.
3. Without the fused element-wise kernels (batch 1), and with each quantized KV cache (``--kv-dtypes``:
   decode tokens/s at ``--kv-batch`` sequences of ``--kv-context`` tokens, where the cache's reads are
   a large part of a step), each a fresh engine measured right after the default one.

Needs CUDA and triton; exits with a message and status 2 (and writes nothing) elsewhere.

    .venv/bin/python -m bench.gpu_decode [--concurrency 32 64] [--out results.json]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

from bench.common import save, say

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16",
}  # fmt: skip


def llama3_folder() -> Path:
    """A fresh folder holding only LLAMA3_8B's config.json (the engine loads it with dummy weights);
    exits with status 2 first where there is no CUDA device."""
    if not torch.cuda.is_available():
        say("no CUDA device: this benchmark runs only on a GPU machine; nothing written")
        sys.exit(2)
    folder = Path(tempfile.mkdtemp(prefix="cachegw-llama3-8b-"))
    (folder / "config.json").write_text(json.dumps(LLAMA3_8B))
    return folder


def measured_bandwidth() -> float:
    """Bytes/s of a 4 GiB device-to-device copy (each byte read once and written once)."""
    src = torch.empty(2**30, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * src.nbytes * 10 / (time.perf_counter() - start)


def decode_rate(llm, prompt_len: int, new_tokens: int, batch: int) -> float:
    """Output tokens/s of the decode phase (after every first token)."""
    from cachegw.backend import SamplingParams

    rng = random.Random(batch)
    prompts = [[rng.randrange(1000, 100000) for _ in range(prompt_len)] for _ in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    outs = llm.generate(prompts, params)
    first = max(o.metrics.first_token_time for o in outs)
    last = max(o.metrics.finish_time for o in outs)
    total = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
    return total / (last - first)


def end_to_end(llm, prompts: list[list[int]], new_tokens: int) -> float:
    from cachegw.backend import SamplingParams

    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True))
    return len(prompts) * new_tokens / (time.perf_counter() - start)


def hf_model(model_dir: Path):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        ids = torch.tensor([list(range(1000, 1016))], device="cuda")
        model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)  # warm-up
    return model


def hf_end_to_end(model, prompts: list[list[int]], new_tokens: int) -> float:
    ids = torch.tensor(prompts, device="cuda")
    with torch.no_grad():
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)  # fmt: skip
        torch.cuda.synchronize()
    return len(prompts) * new_tokens / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[64])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--batch1-tokens", type=int, default=256, help="tokens the batch-1 decode times")
    ap.add_argument(
        "--kv-dtypes",
        nargs="*",
        default=["int8", "int8-packed", "fp8"],
        help="quantized caches to time (int8-packed: int8 rows not aligned, as before)",
    )
    ap.add_argument("--kv-only", action="store_true", help="time only the KV cache formats")
    ap.add_argument("--kv-batch", type=int, default=64)
    ap.add_argument("--kv-context", type=int, default=1024, help="prompt tokens of each sequence")
    ap.add_argument("--kv-tokens", type=int, default=64, help="decoded tokens timed")
    ap.add_argument("--out", type=Path, default=None, help="JSON file (default: bench/results/)")
    args = ap.parse_args()
    tmp = llama3_folder()
    from cachegw.backend import LLM
    from cachegw.backend.executor.layers import kv_quant

    say("building a Llama-3-8B-shaped engine with dummy bf16 weights")

    def engine(**kw):
        return LLM(model=str(tmp), load_format="dummy", dtype="bfloat16", max_num_seqs=max(args.concurrency),
                   max_model_len=4096, gpu_memory_utilization=0.45, **kw)  # fmt: skip

    llm = engine()
    fused = llm.engine.runner.fused_elementwise
    weight_bytes = sum(p.nbytes for p in llm.engine.runner.model.parameters())
    bandwidth = measured_bandwidth()
    say(f"weights {weight_bytes / 1e9:.2f} GB, copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    bound = bandwidth / weight_bytes
    rate1 = 0.0 if args.kv_only else decode_rate(llm, 128, args.batch1_tokens, 1)
    kv_rates = (
        {"auto": decode_rate(llm, args.kv_context, args.kv_tokens, args.kv_batch)} if args.kv_dtypes else {}
    )
    if rate1:
        say(f"batch-1 decode {rate1:.1f} tok/s = {rate1 / bound:.0%} of the {bound:.0f} tok/s bound")
    rng = random.Random(0)
    prompts = {n: [[rng.randrange(1000, 100000) for _ in range(args.prompt_len)] for _ in range(n)]
               for n in args.concurrency}  # fmt: skip
    ours = {} if args.kv_only else {n: end_to_end(llm, prompts[n], args.new_tokens) for n in args.concurrency}
    for n, rate in ours.items():
        say(f"ours at {n} concurrent: {rate:.0f} tok/s")
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    unfused = None
    # the same engine with norms, rotary and SiLU in torch's kernels: what the fusion buys
    if fused and not args.kv_only:
        with mock.patch("cachegw.backend.executor.layers.triton_fused.enable", return_value=False):
            llm = engine()
        unfused = decode_rate(llm, 128, args.batch1_tokens, 1)
        say(f"batch-1 decode without the fused kernels {unfused:.1f} tok/s = {unfused / bound:.0%} of bound")
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    for kv in args.kv_dtypes:  # the same decode with each quantized cache, a fresh engine each
        packed = mock.patch.object(kv_quant, "row_align", return_value=1)  # int8 rows 130 bytes apart
        with packed if kv.endswith("-packed") else contextlib.nullcontext():
            llm = engine(kv_cache_dtype=kv.removesuffix("-packed"))
        kv_rates[kv] = decode_rate(llm, args.kv_context, args.kv_tokens, args.kv_batch)
        say(
            f"{args.kv_batch} x {args.kv_context}-token contexts, {kv} KV cache: {kv_rates[kv]:.0f} tok/s "
            f"({kv_rates[kv] / kv_rates['auto']:.2f}x the bfloat16 cache's {kv_rates['auto']:.0f}; "
            f"attention {llm.engine.runner.attention_backend}, {len(llm.engine.runner.graphs or ())} graphs)"
        )
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    model = None if args.kv_only else hf_model(tmp)
    runs = []
    for n in ours:
        hf = hf_end_to_end(model, prompts[n], args.new_tokens)
        say(f"HF generate, static batch {n}: {hf:.0f} tok/s")
        runs.append({"concurrency": n, "ours_tok_per_s": round(ours[n], 1), "hf_tok_per_s": round(hf, 1),
                     "speedup": round(ours[n] / hf, 2)})  # fmt: skip
    save("gpu_decode", {
        "model": "Llama-3-8B shape, dummy weights, bfloat16", "weight_bytes": weight_bytes,
        "copy_bandwidth_bytes_per_s": bandwidth, "bound_tok_per_s": round(bound, 1),
        "batch1_decode_tok_per_s": round(rate1, 1), "batch1_tokens": args.batch1_tokens,
        "fraction_of_bound": round(rate1 / bound, 3), "fused_elementwise": fused,
        "batch1_unfused_tok_per_s": unfused and round(unfused, 1), "max_num_seqs": max(args.concurrency),
        "kv_dtype_decode": {"batch": args.kv_batch, "context": args.kv_context,
                            "tok_per_s": {k: round(v, 1) for k, v in kv_rates.items()}},
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "runs": runs,
        "targets": {"fraction_of_bound": ">= 0.70", "speedup": ">= 5x"},
    }, args.out)  # fmt: skip


if __name__ == "__main__":
    main()
