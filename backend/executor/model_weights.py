"""Build the model and give it its weights, by the shortest road to the weight mode that runs.

The model is built on the meta device (shapes, no memory). Under a quantized mode over a GGUF
(the default for the embedded model) each projection goes straight from the file's integer blocks
into its int4/int8 layer, one layer at a time; only what stays float (norms, biases, an untied
embedding) is allocated, in the model's dtype. A tied embedding in Q4_0/Q4_1/Q8_0 stays the file's
blocks: the LM head runs them and the lookup dequantizes the rows it reads (``BlockEmbedding``). No float copy
of the projections ever exists, and the memory-mapped file leaves the process once read. Otherwise
(``quantization = "none"``, a safetensors folder, CUDA, random weights) every parameter is
allocated in the model's dtype and filled from the converted safetensors folder, then quantized if
asked.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from cachegw.backend.config import EngineConfig
from cachegw.backend.executor.gguf_table import string_field
from cachegw.backend.executor.gguf_weights import GgufFile
from cachegw.backend.executor.host_memory import release_free_heap
from cachegw.backend.executor.layers.block_embedding import BlockEmbedding
from cachegw.backend.executor.layers.rotary import RotaryEmbedding
from cachegw.backend.executor.model_loader import iter_safetensors
from cachegw.backend.executor.models.llama import LlamaForCausalLM, ModelSpec
from cachegw.backend.executor.models.registry import FAMILIES, check_gguf, family
from cachegw.backend.executor.quantization import (
    apply_quantization,
    chosen_mode,
    log_outcome,
    quantize_model,
    resolve_mode,
    tied_head_from_blocks,
)

_BY_SHARD = sorted(LlamaForCausalLM._FUSED.items(), key=lambda kv: kv[1][1])
# our fused parameter -> the checkpoint's, in row order (q_proj, k_proj, v_proj; gate_proj, up_proj)
_UNFUSED = {
    fused: [part for part, (f, _) in _BY_SHARD if f == fused] for fused in ("qkv_proj", "gate_up_proj")
}
_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def reads_gguf_blocks(config: EngineConfig, gguf: Path | None, device: torch.device) -> bool:
    """The weights come straight from the GGUF's blocks (a quantized mode over a GGUF of a family
    whose blocks load directly: every one but latent attention), so no float copy of them is ever
    converted or read."""
    if config.load_format == "dummy" or gguf is None:
        return False
    arch = string_field(gguf, "general.architecture")
    direct = {a for kind in FAMILIES.values() if kind.gguf_direct for a in kind.gguf_architectures}
    return arch in direct and resolve_mode(config.quantization, device, gguf) != "none"


def needs_weight_files(config: EngineConfig, gguf: Path | None, device: torch.device) -> bool:
    """Whether the engine reads float weights from a (converted) safetensors folder."""
    return config.load_format != "dummy" and not reads_gguf_blocks(config, gguf, device)


# torch.nn.init's fills that modules' reset_parameters call
_INITS = ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_",
          "trunc_normal_", "zeros_", "ones_", "constant_")  # fmt: skip


@contextmanager
def _no_random_init() -> Iterator[None]:
    """Modules built on the meta device skip their random init: it fills nothing there, and torch runs
    a meta tensor's ``normal_``/``uniform_`` through its Python reference ops, which import Dynamo,
    Inductor and sympy (about 60 MiB of a serving process that never compiles)."""
    saved = {name: getattr(nn.init, name) for name in _INITS}
    for name in _INITS:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fill in saved.items():
            setattr(nn.init, name, fill)


def build_model(
    config: EngineConfig,
    spec: ModelSpec,
    hf_config,
    model_dir: Path | None,
    gguf: Path | None,
    device: torch.device,
    dtype: torch.dtype,
    max_model_len: int,
) -> tuple[LlamaForCausalLM, str]:
    """The loaded model in eval mode and what its projections run ("none", "int4", "int8", "mixed")."""
    placeholder = RotaryEmbedding(hf_config, spec.rotary_dim, 1)  # replaced below
    kind = family(hf_config)
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"), _no_random_init():
            model = kind.model.from_config(spec, placeholder, hf_config)
    finally:
        torch.set_default_dtype(torch.float32)
    direct = reads_gguf_blocks(config, gguf, device)
    gguf = gguf if config.load_format != "dummy" else None
    if not direct:
        model.to_empty(device=device)
        model.tie_weights()
    # each attention module's rotary table (Gemma 3: one per layer kind; DeepSeek: the rotary part)
    attention = [m for m in model.modules() if isinstance(getattr(m, "rotary", None), RotaryEmbedding)]
    for module, rotary in zip(attention, model.rotaries(hf_config, max(max_model_len, 1)), strict=True):
        module.rotary = rotary.to(device)
    if direct:
        assert gguf is not None
        formats = load_gguf_quantized(model, gguf, config.quantization, config.cpu_kernels)
        log_outcome(config.quantization, formats, gguf)
        release_free_heap()  # the blocks' conversion: about 11 MiB of free pages otherwise kept
        return model.eval(), chosen_mode(formats)
    if config.load_format == "dummy":
        model.init_dummy_weights(config.seed)
    else:
        assert model_dir is not None
        model.load_weights(iter_safetensors(Path(model_dir)))
    mode = apply_quantization(model, config.quantization, device, gguf, config.cpu_kernels)
    return model.eval(), mode


def _checkpoint_names(param: str) -> list[str]:
    """The checkpoint tensors one of our float parameters is made of (a fused bias: several)."""
    parts = param.split(".")
    if len(parts) >= 2 and parts[-2] in _UNFUSED:
        return [".".join(["model", *parts[:-2], p, parts[-1]]) for p in _UNFUSED[parts[-2]]]
    return [param] if param == "lm_head.weight" else [f"model.{param}"]


def load_gguf_quantized(model: LlamaForCausalLM, gguf: Path, mode: str, kernels: str) -> Counter[str]:
    """Fill a meta-device model from the GGUF: float parameters in the model's dtype, then each
    projection (and the LM head) straight into its quantized layer. Returns the formats made."""
    spec = model.spec
    file = GgufFile(gguf, spec.num_heads, spec.num_kv_heads)
    check_gguf(FAMILIES[spec.architecture], file.architecture, gguf.name)
    try:
        head = tied_head_from_blocks(model, file, kernels) if mode != "none" else None
        if head is not None:  # embedding and LM head: one table, the file's blocks
            model.lm_head = head
            model.embed_tokens = BlockEmbedding(head, model.norm.weight.dtype)  # type: ignore[assignment]
        for name, param in list(model.named_parameters()):
            parts = name.split(".")
            if parts[0] == "layers" and parts[-2] in _PROJECTIONS and parts[-1] == "weight":
                continue  # quantize_model builds these from the file's blocks
            names = _checkpoint_names(name)
            missing = [n for n in names if n not in file]
            if missing:
                raise KeyError(f"{gguf.name} lacks {missing[0]}")
            value = torch.cat([file.dense(n, param.dtype) for n in names])
            if value.shape != param.shape:
                shapes = f"{tuple(value.shape)}, the model wants {tuple(param.shape)}"
                raise ValueError(f"{names[0]} in {gguf.name} is {shapes}")
            owner, attr = name.rsplit(".", 1)
            setattr(model.get_submodule(owner), attr, nn.Parameter(value, requires_grad=False))
        if head is None:
            model.tie_weights()
        formats = quantize_model(model, mode, file, kernels=kernels)
    finally:
        file.close()
    tensors = itertools.chain(model.named_parameters(), model.named_buffers())
    left = [n for n, t in tensors if t.is_meta]
    if left:
        raise KeyError(f"{gguf.name} lacks the weights of {', '.join(left[:3])}")
    return formats
