"""Rotary position embeddings, with the rope settings read from the Hugging Face config.

Scaled variants (llama3, linear, yarn, longrope) of a config the engine read itself are computed in
``rope_scaling.py``, equal to transformers' initialisers bit for bit; a config transformers read (a
family or setting ``model_config.py`` leaves to it) keeps transformers' own initialisers.
"""

from __future__ import annotations

import torch
from torch import nn

from cachegw.backend.executor.layers.rope_scaling import scaled_frequencies
from cachegw.backend.executor.model_config import ModelConfig


def inverse_frequencies(config, head_dim: int, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim / 2], attention scaling) for the config's rope type. ``layer_type``: the
    settings of one kind of layer where the config has one per kind (Gemma 3's local and global
    layers; the global ones when not given)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    per_type = isinstance(params.get("full_attention"), dict)
    if per_type:
        layer_type = layer_type or "full_attention"
        params = params[layer_type]
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    if rope_type == "default":
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        return inv, 1.0
    if rope_type == "dynamic":
        raise ValueError("dynamic NTK rope scaling depends on the sequence length and is not supported")
    if isinstance(config, ModelConfig):
        top = config.rope_parameters  # yarn's "truncate" is read from the top level, as transformers does
        return scaled_frequencies(
            params, config.head_dim, config.max_position_embeddings, top.get("truncate", True)
        )
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    extra = {"layer_type": layer_type} if per_type else {}
    inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), **extra)
    return inv.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    """Rotates q and k by position (the rotate-half layout of Hugging Face checkpoints)."""

    cos: torch.Tensor  # [max_positions, head_dim / 2], float32, times the rope's attention scaling
    sin: torch.Tensor

    def __init__(self, config, head_dim: int, max_positions: int, layer_type: str | None = None) -> None:
        super().__init__()
        inv_freq, scaling = inverse_frequencies(config, head_dim, layer_type)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.register_buffer("cos", freqs.cos() * scaling, persistent=False)
        self.register_buffer("sin", freqs.sin() * scaling, persistent=False)
        self.triton = False  # set by layers/triton_fused.py's ``enable`` on CUDA

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # CUDA: one kernel each
        if self.triton and q.dim() == k.dim() == 3 and q.stride(-1) == k.stride(-1) == 1:
            from cachegw.backend.executor.layers.triton_fused import rotate

            return rotate(q, positions, self.cos, self.sin), rotate(k, positions, self.cos, self.sin)
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """One tensor rotated by position (attention sinks' queries, see ``layers/sinks.py``)."""
        return _rotate(x, self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
