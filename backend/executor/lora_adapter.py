"""A PEFT LoRA adapter folder read and checked against the model it is to run on.

A folder holds ``adapter_config.json`` and ``adapter_model.safetensors`` (``save_pretrained``). Each
targeted projection has ``lora_A`` [r, in] and ``lora_B`` [out, r]; its output gains
``scaling * x @ A.T @ B.T`` with ``scaling = lora_alpha / r`` (``/ sqrt(r)`` under rsLoRA). What this
engine cannot serve is refused with the reason, never dropped: another PEFT method, DoRA, biases,
``modules_to_save``, targets other than the attention and MLP projections, a rank above
``max_lora_rank``, and shapes that are not the loaded model's. Phi-3's fused targets (``qkv_proj``,
``gate_up_proj``) are served as their parts: one A each, B's rows split.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from cachegw.backend.executor.models.llama import ModelSpec

log = logging.getLogger("cachegw.backend")

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Phi-3's checkpoints (so its adapters) fuse projections: one A for the parts, B's rows split among them
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
# adapter_config.json keys whose non-empty values change the computation in ways not served here
_UNSERVED = (
    "use_dora", "lora_bias", "modules_to_save", "fan_in_fan_out", "layer_replication", "alpha_pattern",
    "trainable_token_indices", "use_qalora", "alora_invocation_tokens", "target_parameters",
)  # fmt: skip


class AdapterError(ValueError):
    """An adapter this engine cannot serve on this model, and why."""


@dataclass(frozen=True)
class LoRAWeights:
    """One adapter's matrices, float32: ``modules[(layer, target)] = (A [r, in], B [out, r] x scaling)``."""

    path: Path
    digest: str  # sha256 of its config and weights: what keys its prefix-cache blocks
    rank: int  # the largest of its modules' ranks
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def projection_shapes(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """(in, out) of each target projection of the model."""
    q, kv, h, i = (
        spec.num_heads * spec.head_dim,
        spec.num_kv_heads * spec.head_dim,
        spec.hidden_size,
        spec.intermediate_size,
    )
    return {
        "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
        "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
    }  # fmt: skip


def read_adapter(path: str | Path, spec: ModelSpec, max_rank: int, base_name: str = "") -> LoRAWeights:
    """The adapter in folder ``path``, checked against ``spec``; AdapterError says what is wrong."""
    from safetensors import safe_open

    folder = Path(path).expanduser()
    config_file, weights_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not config_file.is_file() or not weights_file.is_file():
        raise AdapterError(
            f"{folder} is not a PEFT adapter folder (adapter_config.json + adapter_model.safetensors)"
        )
    raw_config = config_file.read_bytes()
    try:
        config = json.loads(raw_config)
    except ValueError as exc:
        raise AdapterError(f"{config_file} is not JSON: {exc}") from None
    _check_config(config, folder)
    base = str(config.get("base_model_name_or_path") or "")
    if base and base_name and Path(base).name.lower() != base_name.lower():
        log.warning("LoRA %s was made on %s; serving it on %s (the shapes match)", folder, base, base_name)
    digest = hashlib.sha256(raw_config)
    digest.update(weights_file.read_bytes())
    halves: dict[tuple[int, str, str], torch.Tensor] = {}
    with safe_open(str(weights_file), framework="pt", device="cpu") as f:
        for key in f.keys():
            m = _KEY.fullmatch(key)
            if m is None or m.group(2) not in (*TARGETS, *FUSED):
                raise AdapterError(
                    f"{folder}: tensor {key} is not a LoRA matrix of {', '.join((*TARGETS, *FUSED))}; "
                    "this engine serves adapters of those projections only"
                )
            halves[(int(m.group(1)), m.group(2), m.group(3))] = f.get_tensor(key).float()
    halves = _unfused(halves, spec, folder)
    modules = _pair_up(halves, spec, config, folder, max_rank)
    if not modules:
        raise AdapterError(f"{folder} holds no LoRA matrices")
    rank = max(a.shape[0] for a, _ in modules.values())
    return LoRAWeights(folder, digest.hexdigest()[:32], rank, modules)


def _check_config(config: dict, folder: Path) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{folder}: peft_type {config.get('peft_type')}; only LORA adapters are served")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{folder}: bias = {config['bias']!r}; only adapters without biases are served")
    for key in _UNSERVED:
        if config.get(key):
            raise AdapterError(f"{folder}: {key} = {config[key]!r} is not served by this engine")


def _unfused(halves: dict[tuple[int, str, str], torch.Tensor], spec: ModelSpec, folder: Path) -> dict:
    """A fused target's matrices as its parts': the same A each, B's rows in the parts' order."""
    shapes = projection_shapes(spec)
    out = {}
    for (layer, target, half), w in halves.items():
        parts = FUSED.get(target)
        if parts is None:
            out[(layer, target, half)] = w
            continue
        sizes = [shapes[p][1] for p in parts]
        if half == "B" and w.shape[0] != sum(sizes):
            raise AdapterError(
                f"{folder}: layer {layer} {target}: B has {w.shape[0]} rows, the model's {'+'.join(parts)} "
                f"{sum(sizes)}; not an adapter of this base"
            )
        pieces = w.split(sizes) if half == "B" else [w] * len(parts)
        out.update({(layer, p, half): piece for p, piece in zip(parts, pieces, strict=True)})
    return out


def _pair_up(
    halves: dict[tuple[int, str, str], torch.Tensor],
    spec: ModelSpec,
    config: dict,
    folder: Path,
    max_rank: int,
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    shapes = projection_shapes(spec)
    alpha = float(config.get("lora_alpha", 8))
    rslora = bool(config.get("use_rslora"))
    modules = {}
    for layer, target in sorted({(layer, target) for layer, target, _ in halves}):
        a, b = halves.get((layer, target, "A")), halves.get((layer, target, "B"))
        where = f"{folder}: layer {layer} {target}"
        if a is None or b is None:
            raise AdapterError(f"{where} has lora_A or lora_B alone")
        if layer >= spec.num_layers:
            raise AdapterError(
                f"{where}: the model has {spec.num_layers} layers; not an adapter of this base"
            )
        rank = a.shape[0]
        if a.shape != (rank, shapes[target][0]) or b.shape != (shapes[target][1], rank):
            raise AdapterError(
                f"{where}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit the model's "
                f"{shapes[target][0]} -> {shapes[target][1]} projection; not an adapter of this base"
            )
        if rank > max_rank:
            raise AdapterError(f"{where}: rank {rank} is above [engine] max_lora_rank = {max_rank}")
        scaling = alpha / (math.sqrt(rank) if rslora else rank)
        modules[(layer, target)] = (a.contiguous(), (b * scaling).contiguous())
    return modules
