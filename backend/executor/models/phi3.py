"""Phi-3 (mini/medium, 4k and 128k with plain rope): Llama's decoder as it is, the checkpoint's
projections already fused (``qkv_proj``, ``gate_up_proj``). LongRoPE ("longrope"/"su": two sets of
frequency factors switched by the sequence's length) and a partial rotary dimension are refused."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from cachegw.backend.executor.layers.rotary import RotaryEmbedding
from cachegw.backend.executor.models.llama import LlamaForCausalLM, ModelSpec

# a fused checkpoint tensor -> the names of its parts, in row order, as Llama's loader takes them
_SPLIT = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def check_rope(hf_config) -> None:
    """Refuse the rope variants this engine would get wrong, at start, with the reason."""
    rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in ("longrope", "su"):
        raise ValueError(
            "Phi-3 with LongRoPE scaling (rope_type 'longrope'/'su', the 128k models) is not supported: "
            "its frequencies switch with the sequence length; use a 4k model or plain rope"
        )
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("Phi-3 with a partial rotary dimension (partial_rotary_factor < 1) is not supported")


class Phi3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def from_config(cls, spec: ModelSpec, rotary: RotaryEmbedding, hf_config) -> LlamaForCausalLM:
        check_rope(hf_config)
        return cls(spec, rotary)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._split(weights))

    def _split(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Each fused tensor as its parts, so the loader's own fusing (and its check that every part
        arrived) applies unchanged."""
        for name, tensor in weights:
            parts = name.split(".")
            fused = parts[-2] if len(parts) >= 2 else ""
            if fused not in _SPLIT:
                yield name, tensor
                continue
            for part, piece in zip(_SPLIT[fused], tensor.split(self._shard_sizes(fused)), strict=True):
                yield ".".join([*parts[:-2], part, parts[-1]]), piece
