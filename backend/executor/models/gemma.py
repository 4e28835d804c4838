"""Gemma 2 and Gemma 3 (text) on Llama's modules.

What differs from Llama: RMSNorm scales by ``1 + w`` (computed in float32), each layer normalizes
its attention and MLP outputs too (four norms a layer), the MLP is GeLU (tanh), embeddings are
multiplied by sqrt(hidden), attention scales by ``query_pre_attn_scalar ** -0.5``, and layers
alternate local (sliding-window) and global attention by the config's ``layer_types``. Gemma 2 caps
attention scores and final logits with ``cap * tanh(x / cap)`` (the scores through the unfused path
of ``layers/softcap.py``); Gemma 3 caps neither, normalizes each head of q and k, and gives its
local layers their own rope base (``RotaryEmbedding``'s ``layer_type``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cachegw.backend.executor.layers.attention import StepMetadata
from cachegw.backend.executor.layers.rotary import RotaryEmbedding
from cachegw.backend.executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM, ModelSpec, RMSNorm

_ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}


class GemmaRMSNorm(RMSNorm):
    """RMSNorm with a zero-centred weight: ``x / rms(x) * (1 + w)``, in float32."""

    def scale(self, h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return (h * (1.0 + self.weight.float())).to(dtype)


class GemmaDecoderLayer(LlamaDecoderLayer):
    """Norms around both the attention and the MLP (``x + norm(f(norm(x)))`` each)."""

    norm_class = GemmaRMSNorm

    def __init__(self, spec: ModelSpec, rotary: RotaryEmbedding, window: int | None = None) -> None:
        super().__init__(spec, rotary, window)
        self.pre_feedforward_layernorm = GemmaRMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, meta: StepMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # the same contract as Llama's layer: the hidden state is x + residual
        hidden = x if residual is None else x + residual
        h = self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(hidden), meta))
        hidden = hidden + h  # type: ignore[operator]
        h = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))
        return h, hidden  # type: ignore[return-value]


@dataclass(frozen=True)
class GemmaOptions:
    """What a Gemma config sets beyond ``ModelSpec``."""

    query_scale: float
    attn_softcap: float | None
    final_softcap: float | None
    approximate: str  # F.gelu's: "tanh" for gelu_pytorch_tanh
    qk_norm: bool
    layer_types: tuple[str, ...]

    @classmethod
    def read(cls, hf_config) -> GemmaOptions:
        if getattr(hf_config, "use_bidirectional_attention", False):
            raise ValueError("Gemma with bidirectional attention (an embedding model) is not a causal LM")
        act = getattr(hf_config, "hidden_activation", None) or "gelu_pytorch_tanh"
        if act not in _ACTIVATIONS:
            raise ValueError(f"Gemma hidden_activation {act!r} is not supported")
        layers = hf_config.num_hidden_layers
        return cls(
            query_scale=float(hf_config.query_pre_attn_scalar) ** -0.5,
            attn_softcap=getattr(hf_config, "attn_logit_softcapping", None),
            final_softcap=getattr(hf_config, "final_logit_softcapping", None),
            approximate=_ACTIVATIONS[act],
            qk_norm=hf_config.model_type.startswith("gemma3"),
            layer_types=tuple(getattr(hf_config, "layer_types", None) or ["full_attention"] * layers),
        )


class GemmaForCausalLM(LlamaForCausalLM):
    decoder_layer = GemmaDecoderLayer

    def __init__(self, spec: ModelSpec, rotary: RotaryEmbedding, options: GemmaOptions) -> None:
        super().__init__(spec, rotary)
        self.options = options
        act = functools.partial(F.gelu, approximate=options.approximate)
        for layer in self.layers:
            assert isinstance(layer, GemmaDecoderLayer)
            attention = layer.self_attn
            attention.attn.scale = options.query_scale
            attention.attn.softcap = options.attn_softcap
            layer.mlp.act = act
            if options.qk_norm:
                attention.q_norm = GemmaRMSNorm(spec.head_dim, spec.rms_norm_eps)
                attention.k_norm = GemmaRMSNorm(spec.head_dim, spec.rms_norm_eps)

    @classmethod
    def from_config(cls, spec: ModelSpec, rotary: RotaryEmbedding, hf_config) -> LlamaForCausalLM:
        return cls(spec, rotary, GemmaOptions.read(hf_config))

    def rotaries(self, hf_config, max_positions: int) -> list[RotaryEmbedding]:
        """Gemma 3's config has rope settings per layer type (local layers: base 10,000; global ones:
        1,000,000, maybe scaled); Gemma 2's one set serves all."""
        rope = getattr(hf_config, "rope_parameters", None) or {}
        if not isinstance(rope.get("full_attention"), dict):
            return super().rotaries(hf_config, max_positions)
        head_dim = self.spec.head_dim
        types = self.options.layer_types
        tables = {t: RotaryEmbedding(hf_config, head_dim, max_positions, t) for t in set(types)}
        return [tables[t] for t in types]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # the normalizer rounded to the weights' dtype first, as Gemma's checkpoints were trained
        return x * torch.tensor(self.spec.hidden_size**0.5, dtype=x.dtype, device=x.device)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.options.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
