"""Scaled rope frequencies computed here, for configs the engine reads itself (``model_config.py``).

Each variant is the published recipe, written so that every float32 operation happens in the order
transformers' own initialiser performs it: the tables are then equal bit for bit, which
``tests/test_rope_scaling.py`` checks per variant on released models' settings. "dynamic" NTK is not
here: its frequencies change with the sequence's length, and the engine refuses it.

- ``linear``: every frequency divided by ``factor`` (positions interpolated).
- ``llama3``: long wavelengths divided by ``factor``, short ones kept, the band between blended.
- ``yarn``: per-dimension blend of interpolated and extrapolated frequencies along a linear ramp
  between the correction dimensions, plus an attention (cos/sin) scale.
- ``longrope``: per-dimension factors (the short set within the original context, the long set past
  it) and an attention scale from the context's growth.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

SCALED_TYPES = ("linear", "llama3", "yarn", "longrope")


def _powers(base: float, dim: int) -> torch.Tensor:
    """base ** (2i / dim) for i < dim / 2, in float32."""
    return base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)


def _linear(p: Mapping[str, Any], dim: int) -> tuple[torch.Tensor, float]:
    return 1.0 / _powers(p["rope_theta"], dim) / p["factor"], 1.0


def _llama3(p: Mapping[str, Any], dim: int) -> tuple[torch.Tensor, float]:
    plain = 1.0 / _powers(p["rope_theta"], dim)
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    context = p["original_max_position_embeddings"]
    wavelength = 2 * math.pi / plain
    long_waves = torch.where(wavelength > context / low, plain / factor, plain)
    share = (context / wavelength - low) / (high - low)  # how far into the band: 0 long, 1 short
    blended = (1 - share) * long_waves / factor + share * long_waves
    in_band = (wavelength >= context / high) & (wavelength <= context / low)
    return torch.where(in_band, blended, long_waves), 1.0


def _yarn_scale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(p: Mapping[str, Any], dim: int, max_positions: int, truncate: bool) -> tuple[torch.Tensor, float]:
    base, context = p["rope_theta"], p["original_max_position_embeddings"]
    factor = p.get("factor")
    if factor is None:
        factor = max_positions / context
    scale = p.get("attention_factor")
    if scale is None:
        mscale, all_dims = p.get("mscale"), p.get("mscale_all_dim")
        scale = (
            _yarn_scale(factor, mscale) / _yarn_scale(factor, all_dims)
            if mscale and all_dims
            else _yarn_scale(factor)
        )

    def dimension(rotations: float) -> float:
        """The dimension whose wavelength fits ``rotations`` turns into the original context."""
        return (dim * math.log(context / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = dimension(p.get("beta_fast") or 32), dimension(p.get("beta_slow") or 1)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    kept = 1 - ramp  # the share of each dimension left extrapolated (unscaled)
    powers = _powers(base, dim)
    inv = (1.0 / (factor * powers)) * (1 - kept) + (1.0 / powers) * kept
    return inv, float(scale)


def _longrope(p: Mapping[str, Any], dim: int, max_positions: int, long: bool) -> tuple[torch.Tensor, float]:
    context = p["original_max_position_embeddings"]
    factor = p.get("factor")
    if factor is None:
        factor = max_positions / context
    scale = p.get("attention_factor")
    if scale is None:
        scale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(context))
    factors = torch.tensor(p["long_factor"] if long else p["short_factor"], dtype=torch.float32)
    return 1.0 / (factors * _powers(p["rope_theta"], dim)), float(scale)


def scaled_frequencies(
    params: Mapping[str, Any], head_dim: int, max_positions: int, truncate: bool = True, long: bool = False
) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim / 2], cos/sin scale) for one standardized rope dict (``rope_type`` among
    ``SCALED_TYPES``, ``rope_theta`` and the type's keys present). ``truncate``: yarn's rounding of its
    correction range (read from the config's top-level rope dict, as transformers reads it);
    ``long``: longrope's long factors (past the original context) rather than its short ones."""
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    kind = params["rope_type"]
    if kind == "linear":
        return _linear(params, dim)
    if kind == "llama3":
        return _llama3(params, dim)
    if kind == "yarn":
        return _yarn(params, dim, max_positions, truncate)
    if kind == "longrope":
        return _longrope(params, dim, max_positions, long)
    raise ValueError(f"rope type {kind!r} is not computed here")
