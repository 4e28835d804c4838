"""Which weights become int8/int4 layers, and from what: ``[engine] quantization``.

- ``none``: float weights everywhere (the parity tests' path).
- ``int4`` / ``int8``: every projection in that format. From a GGUF's Q4_0/Q4_1 blocks int4 keeps
  the file's own integers, scales and minimums (lossless); anything else is rounded again.
- ``auto``: what the file holds where a fast kernel exists: Q4_0/Q4_1 as they are, other 2-4 bit
  types as int4, 5-8 bit types as int8, float tensors stay float; a safetensors model stays float.
In every quantized mode the LM head is int8 while the embedding it is tied to stays float for the
lookup, except where the tied embedding is Q4_0/Q4_1/Q8_0 on cachegw's kernels: the head then runs the
file's own blocks and the lookup reads the same blocks (one table, the file's exact values). Norms,
other embeddings and rotary tables stay float. On CUDA the engine runs the dequantized float weights:
these kernels are CPU ones.

Which kernels, ``[engine] cpu_kernels``: ``auto`` runs cachegw's own (``BlockLinear``: int8
activations times the 4/8-bit blocks in integers; the AVX-512 VNNI, AVX-VNNI or AVX2 build, the best
the CPU has) where g++ builds them, else torch's (``Int4Linear``/``Int8Linear``: bfloat16
activations); ``avx512``/``avxvnni``/``avx2`` force one build (refused where the CPU lacks it);
``torch`` always torch's.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import torch
from torch import nn

from cachegw.backend.executor.gguf_weights import BlockWeights, GgufFile, GgufLinear
from cachegw.backend.executor.layers import cpu_kernels
from cachegw.backend.executor.layers.quantized_linear import BlockLinear, Int4Linear, Int8Linear
from cachegw.backend.executor.models.llama import LlamaForCausalLM

log = logging.getLogger("cachegw.backend")

MODES = ("auto", "none", "int8", "int4")
# our fused module -> the checkpoint projections it holds, in row order
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


def resolve_mode(mode: str, device: torch.device, gguf: Path | None) -> str:
    """The mode the engine runs: "none" on CUDA and for "auto" over a float checkpoint."""
    if mode not in MODES:
        raise ValueError(f"[engine] quantization must be one of {', '.join(MODES)}, not {mode!r}")
    if mode != "none" and device.type != "cpu":
        log.info(
            "quantization=%s: the int4/int8 kernels are CPU ones; running float weights on %s", mode, device
        )
        return "none"
    if mode == "auto" and gguf is None:
        return "none"
    return mode


def _auto_format(kind: str) -> str:
    if kind in ("F32", "F16", "BF16", "F64"):
        return "none"
    bits = next((int(c) for c in kind if c.isdigit()), 8)
    return "int4" if bits <= 4 else "int8"


def _concat(blocks: list[BlockWeights]) -> BlockWeights:
    return BlockWeights(
        blocks[0].kind,
        torch.cat([b.q for b in blocks]),
        torch.cat([b.scale for b in blocks]),
        torch.cat([b.offset for b in blocks]),
    )


def use_native_kernels(kernels: str) -> str | None:
    """The op namespace of cachegw's kernels that run (``[engine] cpu_kernels``), None for torch's;
    the log says which and why. A build the setting names but the CPU lacks raises ValueError."""
    status = cpu_kernels.choose(kernels)
    if status.available:
        log.info("cpu_kernels=%s: cachegw's %s build", kernels, status.build)
        return status.ops
    if kernels == "auto":
        log.info("cpu_kernels=auto: torch's kernels (cachegw's: %s)", status.reason)
    return None


def _build(
    fmt: str,
    sources: list[GgufLinear] | None,
    module: nn.Linear,
    compute_dtype: torch.dtype,
    native: str | None,
) -> nn.Module:
    """The quantized layer replacing ``module`` (its bias kept), or ``module`` where no kernel fits.
    ``native``: the op namespace of cachegw's kernels, None for torch's."""
    bias = module.bias
    if native and fmt in ("int4", "int8") and BlockLinear.supports(module.in_features):
        bits = 4 if fmt == "int4" else 8
        exact_kinds = ("Q4_0", "Q4_1") if bits == 4 else ("Q8_0",)
        blocks = [s.blocks for s in sources or [] if s.blocks is not None and s.kind in exact_kinds]
        if sources and len(blocks) == len(sources) and len({s.kind for s in sources}) == 1:
            return BlockLinear.from_blocks(_concat(blocks), bias, native)
        weight = torch.cat([s.to_float() for s in sources]) if sources else module.weight
        return BlockLinear.from_float(weight, bias, bits, native)
    if (
        fmt == "int4"
        and sources
        and all(s.blocks is not None and s.kind in ("Q4_0", "Q4_1") for s in sources)
    ):
        return Int4Linear.from_blocks(_concat([s.blocks for s in sources]), bias, compute_dtype)  # type: ignore[misc]
    weight = torch.cat([s.to_float() for s in sources]) if sources else module.weight
    if fmt == "int4" and Int4Linear.supports(weight.shape[1]):
        return Int4Linear.from_float(weight, bias, compute_dtype)
    if fmt in ("int4", "int8"):
        return Int8Linear.from_float(weight, bias, compute_dtype)
    if module.weight.is_meta:  # loaded straight from the file: this one stays float
        module.weight = nn.Parameter(weight.to(module.weight.dtype), requires_grad=False)
    return module


def quantize_model(
    model: LlamaForCausalLM,
    mode: str,
    gguf: GgufFile | None,
    compute_dtype: torch.dtype = torch.bfloat16,
    kernels: str = "auto",
) -> Counter[str]:
    """Replace the projections (and the LM head) in place, one layer at a time, each from the file's
    tensors where ``gguf`` holds them; returns how many layers got each format. The projections may
    be on the meta device (``gguf_model.load``): every one the file holds is built from the file.
    Under "auto" the LM head stays float when no projection was quantized (a GGUF of float tensors),
    so such a model runs exactly as under "none"."""
    native = use_native_kernels(kernels)
    formats: Counter[str] = Counter()
    for i, layer in enumerate(model.layers):
        for fused, parts in _FUSED.items():
            owner_name, attr = fused.rsplit(".", 1)
            owner = layer.get_submodule(owner_name)
            names = [f"model.layers.{i}.{p}.weight" for p in parts]
            present = gguf is not None and all(n in gguf for n in names)
            sources = [gguf.linear(n) for n in names] if present and gguf is not None else None
            fmt = mode
            if mode == "auto":
                fmts = {_auto_format(s.kind) for s in sources} if sources else {"none"}
                fmt = fmts.pop() if len(fmts) == 1 else "int8"
            new = _build(fmt, sources, getattr(owner, attr), compute_dtype, native)
            setattr(owner, attr, new)
            formats[_format(new)] += 1
    if mode != "none" and (mode != "auto" or set(formats) != {"none"}):
        if not isinstance(model.lm_head, BlockLinear):  # else already built from the file's blocks
            model.lm_head = _head(model, gguf, native, compute_dtype)
        formats["lm_head " + _format(model.lm_head)] += 1
    return formats


def _head(
    model: LlamaForCausalLM, gguf: GgufFile | None, native: str | None, compute_dtype: torch.dtype
) -> nn.Module:
    """The LM head as int8: a Q8_0 head (or the Q8_0 embedding it is tied to) keeps the file's own
    integers on cachegw's kernel; otherwise per block of 32, absmax/127 (which gives a Q8_0 tensor's
    integers back in float32, not from a bfloat16 copy)."""
    head = model.lm_head
    assert isinstance(head, nn.Linear)
    if native and BlockLinear.supports(head.in_features):
        name = "model.embed_tokens.weight" if model.spec.tie_word_embeddings else "lm_head.weight"
        if gguf is not None and name in gguf and gguf.kind(name) == "Q8_0":
            return BlockLinear.from_blocks(gguf.blocks(name), None, native)
        return BlockLinear.from_float(head.weight, None, 8, native)
    return Int8Linear.from_float(head.weight, None, compute_dtype)


def tied_head_from_blocks(model: LlamaForCausalLM, gguf: GgufFile, kernels: str) -> BlockLinear | None:
    """The tied LM head as the file's own Q4_0/Q4_1/Q8_0 blocks on cachegw's kernel (its embedding
    is then looked up in the same blocks: ``BlockEmbedding``), or None where that does not apply."""
    name = "model.embed_tokens.weight"
    native = use_native_kernels(kernels)
    if not (model.spec.tie_word_embeddings and native):
        return None
    if not BlockLinear.supports(model.spec.hidden_size) or name not in gguf:
        return None
    if gguf.kind(name) not in ("Q4_0", "Q4_1", "Q8_0"):
        return None
    return BlockLinear.from_block_rows(gguf.block_rows(name), gguf.rows(name), native)


def _format(layer: nn.Module) -> str:
    """ "none", "int4" or "int8", and whose kernel: "int4 (cachegw)", "int8 (torch)"..."""
    if isinstance(layer, BlockLinear):
        return f"int{layer.bits} (cachegw)"
    if isinstance(layer, (Int4Linear, Int8Linear)):
        return f"int{4 if isinstance(layer, Int4Linear) else 8} (torch)"
    return "none"


def chosen_mode(formats: Counter[str]) -> str:
    """What the projections became: "none", "int4", "int8", or "mixed" (a file of several types)."""
    kinds = {k.split()[0] for k in formats if not k.startswith("lm_head")}
    if not kinds:
        return "none"
    return kinds.pop() if len(kinds) == 1 else "mixed"


def apply_quantization(
    model: LlamaForCausalLM, requested: str, device: torch.device, gguf: Path | None, kernels: str = "auto"
) -> str:
    """Give ``model`` the weights ``[engine] quantization`` asks for (``gguf``: the file whose blocks
    the layers may keep, None for a safetensors or dummy model) and log the outcome, so the start-up
    log says which weight mode runs. Returns that mode (see ``chosen_mode``)."""
    mode = resolve_mode(requested, device, gguf)
    formats = Counter[str]()
    if mode != "none":
        file = GgufFile(gguf, model.spec.num_heads, model.spec.num_kv_heads) if gguf is not None else None
        try:
            formats = quantize_model(model, mode, file, kernels=kernels)
        finally:
            if file is not None:
                file.close()
    log_outcome(requested, formats, gguf)
    return chosen_mode(formats)


def log_outcome(requested: str, formats: Counter[str], gguf: Path | None) -> None:
    """The start-up log's line saying which weight mode runs."""
    chosen = chosen_mode(formats)
    source = gguf.name if gguf is not None else "float checkpoint"
    head = next((k.removeprefix("lm_head ") for k in formats if k.startswith("lm_head")), "float")
    log.info(
        "weights: quantization=%s -> %s (%s; projections %s, LM head %s)",
        requested,
        chosen,
        source,
        {k: v for k, v in formats.items() if not k.startswith("lm_head")} or "float",
        head,
    )
