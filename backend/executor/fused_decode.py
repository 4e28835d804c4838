"""Decode-only steps as one call into cachegw's CPU kernels (``decode_step`` in
``layers/cpu_kernels_decode.h``), where the model is plain enough for it.

A batch-1 decode step of a small model runs ~30 torch ops a layer around its matmuls (norms, rotary,
the KV store, SiLU, adds), each a few microseconds of dispatch and Python: eagerly, as long as the
matmuls themselves. torch.compile fuses them, but its first compile takes minutes of one core on a new
machine. The fused step does the same work in one C++ call a step with nothing to compile but the
kernels (seconds, once per machine), so the engine decodes at full speed from its first request.

It runs where every projection is cachegw's block-quantized linear (int4/int8 weights on
``[engine] cpu_kernels``), activations and the KV cache are float32, and the layers are Llama's own
(RMSNorm, rotate-half rotary over the whole head, SiLU MLP): Llama, SmolLM2, Mistral, Qwen2, Phi-3. Anything
else (LoRA adapters, attention sinks, H2O, softcaps, per-head q/k norms, other norms or activations)
keeps the eager modules, and ``reason`` says why.
"""

from __future__ import annotations

import logging
from typing import cast

import torch
import torch.nn.functional as F

from cachegw.backend.config import EngineConfig
from cachegw.backend.executor.layers.attention import AttentionMetadata, PagedAttention
from cachegw.backend.executor.layers.quantized_linear import BlockLinear
from cachegw.backend.executor.layers.rotary import RotaryEmbedding
from cachegw.backend.executor.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    RMSNorm,
)

log = logging.getLogger("cachegw.backend")

_NONE = torch.empty(0)


def unfused_reason(model: LlamaForCausalLM, kv_dtype: torch.dtype, ops: str | None) -> str | None:
    """Why the fused step cannot run this model (None: it can); ``kv_dtype``: what the KV cache stores,
    ``ops``: the op namespace of cachegw's kernels that run (None: torch's)."""
    if ops is None:
        return "cachegw's CPU kernels are not running"
    spec = model.spec
    if spec.kv_parts != 2 or spec.head_dim % 16 or spec.head_dim > 256 or spec.rotary_dim != spec.head_dim:
        return "the attention's shape"
    if kv_dtype not in (torch.float32, torch.int8):
        return "the KV cache is neither float32 nor int8"
    norm = model.norm
    if type(norm) is not RMSNorm or norm.weight.dtype != torch.float32:
        return "the model's norm"
    for layer in model.layers:
        if type(layer) is not LlamaDecoderLayer or not _plain(layer, norm.eps):
            return f"its {type(layer).__name__} layers"
        projections = (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        )
        if not all(type(p) is BlockLinear and p.ops == ops for p in projections):
            return "a projection is not on cachegw's block-quantized kernels"
    return None


def _plain(layer: LlamaDecoderLayer, eps: float) -> bool:
    attn, mlp = layer.self_attn, layer.mlp
    paged = attn.attn
    return (
        type(attn) is LlamaAttention
        and type(mlp) is LlamaMLP
        and mlp.act is F.silu
        and attn.q_norm is None
        and attn.k_norm is None
        and type(attn.rotary) is RotaryEmbedding
        and type(paged) is PagedAttention
        and paged.softcap is None
        and not paged.sinks
        and paged.scale == attn.head_dim**-0.5
        and all(type(n) is RMSNorm for n in (layer.input_layernorm, layer.post_attention_layernorm))
        and layer.input_layernorm.eps == layer.post_attention_layernorm.eps == eps
    )


class FusedDecode:
    """Hidden states of a decode-only step through ``decode_step``; the weights are gathered once."""

    def __init__(self, model: LlamaForCausalLM, ops: str) -> None:
        self.model = model
        self.op = getattr(torch.ops, ops).decode_step
        self.steps = 0  # decode steps it ran
        self.failed: str | None = None  # why it stopped, after a failure
        layers = [cast(LlamaDecoderLayer, layer) for layer in model.layers]
        self.attention = [cast(PagedAttention, layer.self_attn.attn) for layer in layers]
        weights: list[torch.Tensor] = []
        ints: list[int] = []
        for layer, paged in zip(layers, self.attention, strict=True):
            attn, mlp = cast(LlamaAttention, layer.self_attn), cast(LlamaMLP, layer.mlp)
            rotary = cast(RotaryEmbedding, attn.rotary)
            norms = (cast(RMSNorm, layer.input_layernorm), cast(RMSNorm, layer.post_attention_layernorm))
            weights += [
                norms[0].weight,
                norms[1].weight,
                cast(torch.Tensor, rotary.cos),
                cast(torch.Tensor, rotary.sin),
            ]
            for module in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                proj = cast(BlockLinear, module)
                bias = proj.bias if isinstance(proj.bias, torch.Tensor) else _NONE
                weights += [cast(torch.Tensor, t) for t in (proj.w, proj.d, proj.m)] + [
                    bias.float().contiguous()
                ]
                ints.append(proj.bits)
            ints.append(paged.sliding_window or 0)
        self.weights = [w.detach().contiguous() for w in weights]
        self.ints = ints
        self.heads, self.kv_heads = self.attention[0].num_heads, self.attention[0].num_kv_heads
        self.norm = cast(RMSNorm, model.norm)
        self.eps, self.scale = self.norm.eps, self.attention[0].scale

    def __call__(
        self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor | None:
        """Hidden states [B, hidden] after the final norm, K/V of the step written into the caches; None
        after a failure (logged once; the eager modules then run this step and the later ones, and
        write the same K/V again)."""
        if self.failed is not None:
            return None
        caches = [c for paged in self.attention for c in (paged.k_cache, paged.v_cache)]
        try:
            x = self.model.embed(ids).float().contiguous()
            hidden = self.op(
                x,
                positions,
                meta.slot_mapping,
                meta.block_tables,
                meta.seq_lens,
                self.weights,
                caches,
                self.norm.weight,
                self.ints,
                self.heads,
                self.kv_heads,
                self.eps,
                self.scale,
            )
        except Exception as exc:  # never let the fast path take the engine down
            self.failed = f"{type(exc).__name__}: {exc}"
            log.exception("the fused decode step failed: decoding on the eager modules from now on")
            return None
        self.steps += 1
        return hidden


def fused_decode_for(
    config: EngineConfig,
    device: torch.device,
    model: LlamaForCausalLM,
    kv_dtype: torch.dtype,
    ops: str | None,
) -> FusedDecode | None:
    """The fused step where ``[engine] fused_decode`` asks for it and it can run (logged), else None.
    The caller has ruled out what the modules cannot show: LoRA slots, attention sinks, H2O."""
    if device.type != "cpu" or not config.fused_decode:
        return None
    reason = unfused_reason(model, kv_dtype, ops)
    if reason is not None:
        log.info("decode steps on the eager modules (the fused step cannot run: %s)", reason)
        return None
    log.info("decode-only steps run fused in cachegw's CPU kernels (one call a step, nothing to compile)")
    assert ops is not None
    share_arithmetic(model, ops, kv_dtype)
    return FusedDecode(model, ops)


# builds whose paged_attention puts a KV head's query heads together (cpu_kernels_modules.h): fast
# enough to run every prefill chunk
ROW_ATTENTION = ("cachegw_avx512",)


def share_arithmetic(model: LlamaForCausalLM, ops: str, kv_dtype: torch.dtype = torch.float32) -> None:
    """The modules' norms, SiLU and attention on the fused step's own ops (``cpu_kernels_modules.h``),
    so that a token gives the same bits decoded fused, decoded eagerly, or inside a prefill (any chunk,
    after any prefix-cache hit): the rest of a layer (projections, rotary, adds) has the same bits
    already. Steps of one row per sequence (decodes, a prefix hit's one-token tail) always run the row
    kernel; longer prefill chunks only on builds with the grouped one (``ROW_ATTENTION``): elsewhere it
    made a 2,000-token prompt 1.44x slower than torch's attention (AVX2, docs/benchmarks.md), so there a
    prompt's logits may depend on the prefix cache by rounding. The grouped kernel reads float32 rows
    only: with an int8 cache a 4k prompt's chunks took 1.8x torch's time on the per-head one, so they
    stay on torch's attention (which, as ever with a quantized cache, lets a first chunk see its own
    unquantized K/V)."""
    cast(RMSNorm, model.norm).ops = ops
    for layer in cast(list[LlamaDecoderLayer], list(model.layers)):
        layer.input_layernorm.ops = layer.post_attention_layernorm.ops = ops
        cast(LlamaMLP, layer.mlp).ops = ops
        attn = cast(PagedAttention, layer.self_attn.attn)
        attn.row_ops, attn.row_prefill = ops, ops in ROW_ATTENTION and kv_dtype == torch.float32
