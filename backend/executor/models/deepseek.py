"""DeepSeek-V2/V3 (multi-head latent attention) as plain torch modules on the engine's flat batch.

Each layer projects a token to a compressed latent of ``kv_lora_rank`` values (normalized) plus one
rotary key of ``qk_rope_head_dim`` values shared by all heads; that row is all the paged cache keeps
(``layers/mla_attention.py``). Queries come from the hidden state directly (``q_proj``) or through
their own low-rank bottleneck (``q_lora_rank``: ``q_a_proj``, a norm, ``q_b_proj``). Rotary applies
to the ``qk_rope_head_dim`` part of queries and keys only; DeepSeek lays its pairs out interleaved
(V2 always, V3 by ``rope_interleave``), which is de-interleaved here before the rotate-half rotation:
the same dot products. MLP layers are dense for the first ``first_k_dense_replace`` layers, then a
mixture of experts (``deepseek_moe.py``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from cachegw.backend.executor.layers.attention import StepMetadata
from cachegw.backend.executor.layers.mla_attention import MLAttention
from cachegw.backend.executor.layers.rotary import RotaryEmbedding
from cachegw.backend.executor.models.deepseek_moe import DeepseekMoE, MoESpec
from cachegw.backend.executor.models.llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    ModelSpec,
    RMSNorm,
)

DEEPSEEK_ARCHITECTURES = {"DeepseekV2ForCausalLM": 2, "DeepseekV3ForCausalLM": 3}
LATENT_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm use their default eps, not rms_norm_eps


@dataclass(frozen=True)
class MLASpec(ModelSpec):
    """A latent-attention model: the cache row is ``kv_lora_rank + qk_rope_head_dim`` wide (``head_dim``)
    and one "KV head" (``num_kv_heads = 1``), one part per layer instead of K and V."""

    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = True
    softmax_scale: float = 1.0
    first_k_dense_replace: int = 0
    moe: MoESpec | None = None

    @property
    def kv_parts(self) -> int:
        return 1

    @property
    def rotary_dim(self) -> int:
        return self.qk_rope_head_dim

    @property
    def decode_compiles(self) -> bool:
        """The experts loop depends on the routing's values, which torch.compile cannot trace."""
        return self.moe is None

    @classmethod
    def from_hf_config(cls, config) -> MLASpec:
        arch = config.architectures[0]
        version = DEEPSEEK_ARCHITECTURES[arch]
        layers, bias = config.num_hidden_layers, bool(getattr(config, "attention_bias", False))
        rope, nope = config.qk_rope_head_dim, config.qk_nope_head_dim
        return cls(
            architecture=arch,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=1,
            head_dim=config.kv_lora_rank + rope,
            rms_norm_eps=config.rms_norm_eps,
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=bias,
            o_bias=bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            sliding_windows=(None,) * layers,
            q_lora_rank=getattr(config, "q_lora_rank", None),
            kv_lora_rank=config.kv_lora_rank,
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rope,
            v_head_dim=config.v_head_dim,
            rope_interleave=version == 2 or bool(getattr(config, "rope_interleave", True)),
            softmax_scale=softmax_scale(config, nope + rope),
            first_k_dense_replace=min(getattr(config, "first_k_dense_replace", 0) or 0, layers),
            moe=MoESpec.from_hf_config(config, version),
        )


def softmax_scale(config, qk_head_dim: int) -> float:
    """1/sqrt(qk_head_dim), times YaRN's mscale squared when the rope is scaled with ``mscale_all_dim``."""
    scale = qk_head_dim**-0.5
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    factor, mscale_all_dim = params.get("factor", 1.0), params.get("mscale_all_dim", 0)
    if params.get("rope_type", params.get("type", "default")) != "default" and mscale_all_dim and factor > 1:
        mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Pairs (x0, x1), (x2, x3)... as [x0, x2, ..., x1, x3, ...]: rotate-half's layout of the same pairs."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


class DeepseekAttention(nn.Module):
    def __init__(self, spec: MLASpec, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.spec = spec
        h, qk = spec.num_heads, spec.qk_nope_head_dim + spec.qk_rope_head_dim
        if spec.q_lora_rank:
            self.q_a_proj = nn.Linear(spec.hidden_size, spec.q_lora_rank, bias=spec.qkv_bias)
            self.q_a_layernorm = RMSNorm(spec.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(spec.q_lora_rank, h * qk, bias=False)
        else:
            self.q_proj = nn.Linear(spec.hidden_size, h * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(spec.hidden_size, spec.head_dim, bias=spec.qkv_bias)
        self.kv_a_layernorm = RMSNorm(spec.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(
            spec.kv_lora_rank, h * (spec.qk_nope_head_dim + spec.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(h * spec.v_head_dim, spec.hidden_size, bias=spec.o_bias)
        self.rotary = rotary
        self.attn = MLAttention(
            h,
            spec.kv_lora_rank,
            spec.qk_nope_head_dim,
            spec.qk_rope_head_dim,
            spec.v_head_dim,
            spec.softmax_scale,
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
        s, n = self.spec, x.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if s.q_lora_rank else self.q_proj(x)
        # explicit sizes, no -1: the compiled decode step traces n as an unbacked size
        q = q.view(n, s.num_heads, s.qk_nope_head_dim + s.qk_rope_head_dim)
        q_nope, q_pe = q.split([s.qk_nope_head_dim, s.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([s.kv_lora_rank, s.qk_rope_head_dim], dim=-1)
        k_pe = k_pe[:, None, :]
        if s.rope_interleave:
            q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        q_pe, k_pe = self.rotary(positions, q_pe, k_pe)
        o = self.attn(q_nope, q_pe, self.kv_a_layernorm(latent), k_pe[:, 0], meta, self.kv_b_proj.weight)
        return self.o_proj(o.reshape(n, s.num_heads * s.v_head_dim))


class DeepseekDecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm residual layer (its forward) around latent attention and a dense or MoE MLP."""

    def __init__(self, spec: MLASpec, rotary: RotaryEmbedding, index: int) -> None:  # noqa: D107
        nn.Module.__init__(self)
        self.self_attn = DeepseekAttention(spec, rotary)  # type: ignore[assignment]  # Llama's forward calls it alike
        moe = spec.moe if index >= spec.first_k_dense_replace else None
        self.mlp = LlamaMLP(spec) if moe is None else DeepseekMoE(spec, moe)  # type: ignore[assignment]
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


class DeepseekForCausalLM(LlamaForCausalLM):
    """Llama's embedding, layer loop, final norm and LM head around DeepSeek's layers."""

    def __init__(self, spec: MLASpec, rotary: RotaryEmbedding) -> None:  # noqa: D107
        nn.Module.__init__(self)
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(spec, rotary, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head: nn.Module = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.tie_weights()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Checkpoint tensors by name; gate_proj/up_proj become the halves of our fused gate_up_proj.
        Layers past ``num_hidden_layers`` (V3's multi-token-prediction layer) are skipped."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[tuple[str, int | None]] = set()
        for name, tensor in weights:
            if "rotary_emb" in name or (name == "lm_head.weight" and self.spec.tie_word_embeddings):
                continue
            name = name.removeprefix("model.")
            parts = name.split(".")
            if parts[0] == "layers" and int(parts[1]) >= self.spec.num_layers:
                continue
            shard = {"gate_proj": 0, "up_proj": 1}.get(parts[-2]) if len(parts) > 1 else None
            if shard is not None:
                name = ".".join(parts[:-2] + ["gate_up_proj", parts[-1]])
            param = params.get(name)
            if param is None:
                raise KeyError(f"checkpoint tensor {name!r} has no place in the model")
            with torch.no_grad():
                target = (
                    param
                    if shard is None
                    else param.narrow(0, shard * param.shape[0] // 2, param.shape[0] // 2)
                )
                target.copy_(tensor)
            loaded.add((name, shard))
        expected = {
            (n, s)
            for n in params
            if not (self.spec.tie_word_embeddings and n == "lm_head.weight")
            for s in ((0, 1) if ".gate_up_proj." in n else (None,))
        }
        missing = expected - loaded
        if missing:
            raise KeyError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing, key=str)[:3]}")
