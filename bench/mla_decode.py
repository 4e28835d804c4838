"""Latent-attention decode: the absorbed form against up-projecting the cached latents every step.

One ``MLAttention`` layer at DeepSeek-V2-Lite's attention shape (16 heads, latent 512, rope 64, nope
128, v 128; random weights, float32, CPU), over a paged latent cache: a decode step of ``batch``
sequences, each with ``context`` cached tokens, timed for both forms in alternation (the machine is
shared: compare the ratio, not the absolute times). Both forms give the same output (checked here
to 1e-4 relative); what differs is the work: the expanded form runs the context's latents through
``kv_b_proj`` (every token, every head) each step.

    .venv/bin/python -m bench.mla_decode [--contexts 256,1024,4096] [--batches 1,4] [--reps 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.common import save, say
from cachegw.backend.executor.layers.attention import AttentionMetadata
from cachegw.backend.executor.layers.mla_attention import MLAttention

HEADS, LATENT, ROPE, NOPE, V = 16, 512, 64, 128, 128
BLOCK = 16


def _step(batch: int, context: int) -> tuple[MLAttention, tuple, AttentionMetadata]:
    """A layer whose cache holds ``batch`` sequences of ``context - 1`` tokens, and a decode step's inputs."""
    gen = torch.Generator().manual_seed(0)
    blocks = -(-context // BLOCK)
    attn = MLAttention(HEADS, LATENT, NOPE, ROPE, V, (NOPE + ROPE) ** -0.5)
    attn.k_cache = torch.randn(batch * blocks, BLOCK, 1, LATENT + ROPE, generator=gen)
    tables = torch.arange(batch * blocks, dtype=torch.int32).view(batch, blocks)
    meta = AttentionMetadata(
        slot_mapping=(tables[:, (context - 1) // BLOCK] * BLOCK + (context - 1) % BLOCK).long(),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
        seq_lens=torch.full((batch,), context, dtype=torch.int32),
        block_tables=tables,
        max_query_len=1,
        max_seq_len=context,
        num_decodes=batch,
        query_lens_cpu=[1] * batch,
        seq_lens_cpu=[context] * batch,
    )
    inputs = (
        torch.randn(batch, HEADS, NOPE, generator=gen),
        torch.randn(batch, HEADS, ROPE, generator=gen),
        torch.randn(batch, LATENT, generator=gen),
        torch.randn(batch, ROPE, generator=gen),
        meta,
        torch.randn(HEADS * (NOPE + V), LATENT, generator=gen) * LATENT**-0.5,
    )
    return attn, inputs, meta


@torch.inference_mode()
def measure(batch: int, context: int, reps: int) -> dict:
    attn, inputs, _ = _step(batch, context)
    times: dict[str, list[float]] = {"absorbed": [], "expanded": []}
    outs = {}
    for _ in range(reps + 1):  # the first round warms up and is dropped
        for form in times:
            MLAttention.absorb = form == "absorbed"
            start = time.perf_counter()
            outs[form] = attn(*inputs)
            times[form].append(time.perf_counter() - start)
    MLAttention.absorb = True
    assert torch.allclose(outs["absorbed"], outs["expanded"], rtol=1e-4, atol=1e-4)
    ms = {form: 1000 * statistics.median(t[1:]) for form, t in times.items()}
    row = {"batch": batch, "context": context, **{f"{k}_ms": round(v, 3) for k, v in ms.items()}}
    row["expanded_over_absorbed"] = round(ms["expanded"] / ms["absorbed"], 2)
    say(f"batch {batch} context {context}: {row}")
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="256,1024,4096")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    batches, contexts = (list(map(int, a.split(","))) for a in (args.batches, args.contexts))
    rows = [measure(b, c, args.reps) for b in batches for c in contexts]
    shape = {"heads": HEADS, "kv_lora_rank": LATENT, "rope": ROPE, "nope": NOPE, "v": V, "block_size": BLOCK}
    save("mla_decode", {"shape": shape, "threads": args.threads, "dtype": "float32", "rows": rows})


if __name__ == "__main__":
    main()
