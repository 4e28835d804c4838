"""The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2/2.5) as plain torch modules; the other
families (``qwen3.py``, ``gemma.py``, ``phi3.py``) are these modules with a few parts swapped.

The model runs on a flat batch of tokens from many sequences at once (no padding): ``input_ids``
and ``positions`` are [T]; attention reads and writes the paged KV cache through the step's
``AttentionMetadata`` (``DecodeMetadata`` in the compiled decode step). Q/K/V and gate/up are
fused into one matmul each, which matters on CPU where a batch-1 decode step is bound by per-op
overhead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from cachegw.backend.executor.layers.attention import PagedAttention, StepMetadata
from cachegw.backend.executor.layers.kv_quant import KVCacheFormat
from cachegw.backend.executor.layers.rotary import RotaryEmbedding

# Architectures whose sliding window (when set) applies to every layer, as transformers' own models do.
WINDOW_EVERY_LAYER = ("MistralForCausalLM", "Phi3ForCausalLM")
_NONE = torch.empty(0)


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a model, read from its Hugging Face config."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    # Per layer: how many positions (itself included) a query sees, or None for the whole context.
    sliding_windows: tuple[int | None, ...] = ()

    @property
    def window_everywhere(self) -> int | None:
        """The window when every layer has the same one: only then can old KV blocks be freed."""
        windows = set(self.sliding_windows)
        return windows.pop() if len(windows) == 1 and None not in windows else None

    @classmethod
    def from_hf_config(cls, config) -> ModelSpec:
        """The shape every family shares; which architectures load is ``models/registry.py``'s call."""
        arch = architecture(config)
        heads = config.num_attention_heads
        attention_bias = bool(getattr(config, "attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            rms_norm_eps=config.rms_norm_eps,
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases and no o_proj bias; Llama's flag covers all four.
            qkv_bias=attention_bias or arch == "Qwen2ForCausalLM",
            o_bias=attention_bias and arch != "Qwen2ForCausalLM",
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            sliding_windows=layer_windows(config, arch),
        )

    @property
    def kv_parts(self) -> int:
        """Cache tensors per layer: K and V (a latent-attention model keeps one: ``models/deepseek.py``)."""
        return 2

    @property
    def rotary_dim(self) -> int:
        return self.head_dim

    @property
    def decode_compiles(self) -> bool:
        """Whether the compiled decode step can trace the model (``executor/compiled_decode.py``)."""
        return True

    def kv_bytes_per_token(self, dtype: torch.dtype, kv_cache_dtype: str = "auto", align: int = 1) -> int:
        """K and V, every layer: 2 x layers x kv_heads x the bytes of one stored row (``head_dim``
        elements of ``dtype``, or their int8/fp8 form and its scale, padded to ``align``:
        ``layers/kv_quant.py``)."""
        row = KVCacheFormat(kv_cache_dtype, dtype, self.head_dim, align).row_bytes
        return self.kv_parts * self.num_layers * self.num_kv_heads * row


def architecture(config) -> str:
    """The config's model class name (a config without one is Llama's)."""
    return (getattr(config, "architectures", None) or ["LlamaForCausalLM"])[0]


def layer_windows(config, arch: str) -> tuple[int | None, ...]:
    """Each layer's sliding window, as transformers' own model of ``arch`` applies it.

    Llama ignores ``sliding_window``; Mistral and Phi-3 apply it to every layer (their models ignore
    ``layer_types``); Qwen2/3 and Gemma 2/3 follow ``layer_types``, which Qwen's config derives from
    ``use_sliding_window`` and ``max_window_layers`` (layers from that index on slide) and Gemma's
    from its local/global pattern.
    """
    layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if arch == "LlamaForCausalLM" or not window:
        return (None,) * layers
    if arch in WINDOW_EVERY_LAYER:
        return (int(window),) * layers
    if not getattr(config, "use_sliding_window", True):
        return (None,) * layers
    types = getattr(config, "layer_types", None) or [
        "sliding_attention" if i >= getattr(config, "max_window_layers", layers) else "full_attention"
        for i in range(layers)
    ]
    return tuple(int(window) if t == "sliding_attention" else None for t in types)


class RMSNorm(nn.Module):
    """RMSNorm in float32 whatever the weights' dtype; optionally adds the residual first."""

    # cachegw's kernels' op namespace where the fused decode step runs: the norm as it computes it
    ops: str | None = None
    triton = False  # CUDA: layers/triton_fused.py's one kernel for 2-D rows (set by its ``enable``)

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        rows = x.dim() == 2 and x.stride(-1) == 1 and (residual is None or residual.stride(-1) == 1)
        if self.triton and rows:
            from cachegw.backend.executor.layers import triton_fused

            return triton_fused.rms_norm(x, residual, self.weight, self.eps)
        if self.ops is not None:
            added = _NONE if residual is None else residual
            parts = getattr(torch.ops, self.ops).rms_norm(x, added, self.weight, self.eps)
            return parts[0] if residual is None else (parts[0], parts[1])
        if residual is not None:
            x = x + residual
            residual = x
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.scale(h, x.dtype)
        return out if residual is None else (out, residual)

    def scale(self, h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The normalized rows (float32) times the weight, in ``dtype``: Llama rounds them first."""
        return self.weight * h.to(dtype)


class LlamaAttention(nn.Module):
    def __init__(self, spec: ModelSpec, rotary: RotaryEmbedding, window: int | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.qkv_proj = nn.Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, bias=spec.o_bias)
        self.rotary = rotary
        # per-head norms of q and k before the rotation (Qwen3, Gemma 3): set by those families
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        self.attn = PagedAttention(
            spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.head_dim**-0.5, sliding_window=window
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # Attention sinks see each query as if at the last position of a full cache: see layers/sinks.py.
        q_sink = self.rotary.rotate(positions.clamp(max=self.attn.span - 1), q) if self.attn.sinks else None
        q, k = self.rotary(positions, q, k)
        o = self.attn(q, k, v.view(n, self.num_kv_heads, self.head_dim), meta, q_sink)
        return self.o_proj(o.view(n, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)
        self.act: Callable[[torch.Tensor], torch.Tensor] = F.silu  # Gemma: GeLU (tanh)
        self.ops: str | None = None  # as RMSNorm.ops: SiLU(gate) * up in cachegw's kernels
        self.triton = False  # as RMSNorm.triton

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None:
            return self.down_proj(getattr(torch.ops, self.ops).silu_mul(self.gate_up_proj(x)))
        if self.triton:
            from cachegw.backend.executor.layers import triton_fused

            return self.down_proj(triton_fused.silu_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class LlamaDecoderLayer(nn.Module):
    norm_class: type[RMSNorm] = RMSNorm  # every norm of the model (Gemma's scales by 1 + w)

    def __init__(self, spec: ModelSpec, rotary: RotaryEmbedding, window: int | None = None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(spec, rotary, window)
        self.mlp = LlamaMLP(spec)
        self.input_layernorm = self.norm_class(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = self.norm_class(spec.hidden_size, spec.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, meta: StepMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(positions, h, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    decoder_layer: type[LlamaDecoderLayer] = LlamaDecoderLayer
    # checkpoint name -> (our fused parameter, shard index)
    _FUSED = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, spec: ModelSpec, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        windows = spec.sliding_windows or (None,) * spec.num_layers
        self.layers = nn.ModuleList(self.decoder_layer(spec, rotary, w) for w in windows)
        self.norm = self.decoder_layer.norm_class(spec.hidden_size, spec.rms_norm_eps)
        # an nn.Linear, or a weight-only quantized layer (backend/executor/quantization.py)
        self.lm_head: nn.Module = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.tie_weights()

    @classmethod
    def from_config(cls, spec: ModelSpec, rotary: RotaryEmbedding, hf_config) -> LlamaForCausalLM:
        """The model for ``hf_config`` (a family with settings beyond ``ModelSpec`` reads them here)."""
        return cls(spec, rotary)

    def tie_weights(self) -> None:
        """Share the embedding with the LM head; again after ``to_empty``, which unties them."""
        if self.spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def rotaries(self, hf_config, max_positions: int) -> list[RotaryEmbedding]:
        """Each layer's rotary embedding: one shared table here (Gemma 3: one per layer type)."""
        one = RotaryEmbedding(hf_config, self.spec.rotary_dim, max_positions)
        return [one] * self.spec.num_layers

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm."""
        x = self.embed(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def _shard_sizes(self, fused: str) -> list[int]:
        s = self.spec
        if fused == "qkv_proj":
            return [s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.num_kv_heads * s.head_dim]
        return [s.intermediate_size, s.intermediate_size]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face checkpoint tensors into our (partly fused) parameters."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb" in name or (name == "lm_head.weight" and self.spec.tie_word_embeddings):
                continue
            name = name.removeprefix("model.")
            parts = name.split(".")
            target = name
            shard = None
            for i, part in enumerate(parts):
                if part in self._FUSED:
                    fused, shard = self._FUSED[part]
                    target = ".".join(parts[:i] + [fused] + parts[i + 1 :])
                    break
            if target not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no place in the model")
            param = params[target]
            with torch.no_grad():
                if shard is None:
                    param.copy_(tensor)
                else:
                    sizes = self._shard_sizes(target.split(".")[-2])
                    param.narrow(0, sum(sizes[:shard]), sizes[shard]).copy_(tensor)
            loaded.add(f"{target}#{shard}")
        expected = set()
        for pname in params:
            if self.spec.tie_word_embeddings and pname == "lm_head.weight":
                continue
            fused = pname.split(".")[-2] if "." in pname else ""
            n = len(self._shard_sizes(fused)) if fused in ("qkv_proj", "gate_up_proj") else 0
            expected |= {f"{pname}#{i}" for i in range(n)} if n else {f"{pname}#None"}
        missing = expected - loaded
        if missing:
            raise KeyError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")

    def init_dummy_weights(self, seed: int = 0) -> None:
        """Small random weights: for benchmarks of large shapes without a checkpoint."""
        gen = torch.Generator(device=self.embed_tokens.weight.device).manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight") or "layernorm" in name:
                    p.fill_(1.0)
                else:
                    p.uniform_(-0.02, 0.02, generator=gen)
