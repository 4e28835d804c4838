"""Qwen3 (dense): Qwen2's decoder without the q/k/v biases, with an RMSNorm over each head of q and
k before the rotation. Everything else is Llama's modules."""

from __future__ import annotations

from cachegw.backend.executor.layers.rotary import RotaryEmbedding
from cachegw.backend.executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM, ModelSpec


class Qwen3ForCausalLM(LlamaForCausalLM):
    def __init__(self, spec: ModelSpec, rotary: RotaryEmbedding) -> None:
        super().__init__(spec, rotary)
        norm = self.decoder_layer.norm_class
        for layer in self.layers:
            assert isinstance(layer, LlamaDecoderLayer)
            layer.self_attn.q_norm = norm(spec.head_dim, spec.rms_norm_eps)
            layer.self_attn.k_norm = norm(spec.head_dim, spec.rms_norm_eps)
