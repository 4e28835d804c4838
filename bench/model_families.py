"""Decode speed of each model family at one small shape: ours (eager, float32) against transformers'
``generate`` on the same random weights, one family after the other in one run.

The shape is small (8 layers, hidden 512), so the figures say what each family's extra parts cost
next to Llama's at equal size (Gemma 2's unfused capped attention, four norms a layer, q/k norms), not
what a real checkpoint would run at.

    flock /tmp/cachegw-bench.lock .venv/bin/python -m bench.model_families
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

SHAPE: dict[str, Any] = dict(
    vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
    num_key_value_heads=4, head_dim=64, max_position_embeddings=1024, rms_norm_eps=1e-6,
)  # fmt: skip


def config(kind: str):
    from transformers import Gemma2Config, Gemma3TextConfig, LlamaConfig, Phi3Config, Qwen3Config

    if kind == "gemma2":
        return Gemma2Config(**SHAPE, sliding_window=128, query_pre_attn_scalar=64)
    if kind == "gemma3":
        return Gemma3TextConfig(**SHAPE, sliding_window=128, query_pre_attn_scalar=64)
    if kind == "phi3":  # its default pad id (32000) lies outside this vocabulary
        return Phi3Config(**SHAPE, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return {"llama": LlamaConfig, "qwen3": Qwen3Config}[kind](**SHAPE)


def run(kind: str, batch: int, prompt_len: int, new: int) -> dict:
    from transformers import AutoModelForCausalLM

    from cachegw.backend import LLM, SamplingParams

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config(kind), dtype=torch.float32).eval()
    prompts = [[(7 * i + j) % 4000 + 10 for j in range(prompt_len)] for i in range(batch)]
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder)
        llm = LLM(
            model=folder, dtype="float32", kv_cache_tokens=batch * (prompt_len + new) * 2, compile="off"
        )
        params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm up
        start = time.perf_counter()
        llm.generate(prompts, params)
        ours = batch * new / (time.perf_counter() - start)
        del llm
    ids = torch.tensor(prompts)
    with torch.no_grad():
        start = time.perf_counter()
        hf.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        theirs = batch * new / (time.perf_counter() - start)
    return {
        "family": kind,
        "ours_tok_s": round(ours, 1),
        "hf_tok_s": round(theirs, 1),
        "ratio": round(ours / theirs, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--out", default="bench/results/model_families.json")
    args = parser.parse_args()
    torch.set_num_threads(2)
    rows = []
    for kind in ("llama", "qwen3", "gemma2", "gemma3", "phi3"):
        rows.append(run(kind, args.batch, args.prompt_len, args.new))
        print(json.dumps(rows[-1]), flush=True)
    Path(args.out).write_text(json.dumps({"shape": SHAPE, "args": vars(args), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
