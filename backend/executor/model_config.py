"""The model's config.json as our own record: transformers' config classes stay out of the serving process.

Importing transformers' ``AutoConfig`` pulls in its model-loading stack (torch.distributed's tensor
ops among it): 61 MiB of a serving process to read one JSON file. The families the engine runs on
Llama's modules (Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3 text, Phi-3) are read here, each
missing key given the default transformers' class of that family gives it, and the rope settings
standardized as that class standardizes them (legacy ``rope_scaling``/``rope_theta`` keys, Gemma 3's
per-layer-type settings, Phi-3's ``original_max_position_embeddings``); their scaled variants' tables
come from ``layers/rope_scaling.py``. What is not read here goes to transformers, as before
(``read_model_config``): other families (DeepSeek's mixture of experts), rope types the engine does
not compute, and any config transformers would reject or read in a way not repeated here (a missing
shape key, a required rope key missing, a model type that is not the architecture's).
``tests/test_model_config_families.py`` checks that both readings give the same ``ModelSpec``, rope
settings and tables, and stop tokens.
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("cachegw.backend")

_GEMMA: dict[str, Any] = {"num_key_value_heads": 4, "head_dim": 256, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True, "eos_token_id": 1, "bos_token_id": 2, "query_pre_attn_scalar": 256,
    "sliding_window": 4096, "hidden_activation": "gelu_pytorch_tanh"}  # fmt: skip
# Each family's model type and its class defaults where they differ from Llama's (the keys a
# config.json may leave out). None: the key's default is the head count (``num_key_value_heads``).
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {"model_type": "llama", "eos_token_id": 2, "bos_token_id": 1},
    "MistralForCausalLM": {"model_type": "mistral", "sliding_window": 4096, "eos_token_id": 2,
                           "bos_token_id": 1},
    "Qwen2ForCausalLM": {"model_type": "qwen2", "use_sliding_window": False, "sliding_window": 4096,
                         "max_window_layers": 28},
    "Qwen3ForCausalLM": {"model_type": "qwen3", "use_sliding_window": False, "sliding_window": 4096,
                         "max_window_layers": 28},
    "Gemma2ForCausalLM": {**_GEMMA, "model_type": "gemma2", "final_logit_softcapping": 30.0,
                          "attn_logit_softcapping": 50.0},
    "Gemma3ForCausalLM": {**_GEMMA, "model_type": "gemma3_text", "final_logit_softcapping": None,
                          "attn_logit_softcapping": None, "use_bidirectional_attention": False},
    "Phi3ForCausalLM": {"model_type": "phi3", "rms_norm_eps": 1e-5, "eos_token_id": 32000, "bos_token_id": 1,
                        "sliding_window": None, "original_max_position_embeddings": 4096},
}  # fmt: skip
# Keys whose class default is the family's size, not a shape we should guess.
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "max_position_embeddings")  # fmt: skip
# Each rope type the engine computes (or refuses, "dynamic") and the keys transformers requires of it.
_ROPE_KEYS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
}
_CONTEXT_KEYED = ("llama3", "yarn", "longrope")  # types given the original context length


@dataclass(frozen=True)
class ModelConfig:
    """What the engine reads of a model's config (names as in config.json; ``rope_parameters`` as
    transformers standardizes it)."""

    architectures: tuple[str, ...]
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    rope_parameters: dict[str, Any]
    sliding_window: int | None
    use_sliding_window: bool
    max_window_layers: int
    layer_types: tuple[str, ...] | None
    eos_token_id: int | list[int] | None
    bos_token_id: int | None
    # Gemma's (``models/gemma.py``); None for the other families, whose classes have no such keys
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    hidden_activation: str | None = None
    use_bidirectional_attention: bool | None = None
    rope_scaling: None = field(default=None)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig | None:
        """The record, or None where transformers should read the config (see the module's doc)."""
        arch = (raw.get("architectures") or ["LlamaForCausalLM"])[0]
        if arch not in _FAMILY_DEFAULTS or any(raw.get(k) is None for k in _REQUIRED):
            return None
        family = _FAMILY_DEFAULTS[arch]
        if raw.get("model_type") != family["model_type"] or raw.get("use_bidirectional_attention"):
            return None  # AutoConfig picks its class by model type; bidirectional Gemma is not causal
        if raw.get("num_key_value_heads") is None and arch.startswith(("Mistral", "Qwen")):
            return None  # Mistral's and Qwen's classes default to a count of their own
        if "head_dim" in raw and raw["head_dim"] is None:
            return None
        c = {**family, **raw}

        def get(key: str, default: Any) -> Any:
            return default if c.get(key) is None else c[key]

        heads, layers, hidden = (
            int(c["num_attention_heads"]),
            int(c["num_hidden_layers"]),
            int(c["hidden_size"]),
        )
        head_dim = int(get("head_dim", hidden // heads))
        if hidden % heads or (head_dim > 4 and head_dim % 2):
            return None  # transformers refuses these shapes
        slides = bool(get("use_sliding_window", True))
        window = c.get("sliding_window") if slides or not arch.startswith("Qwen") else None  # Qwen's class
        types = c.get("layer_types") or _gemma_layer_types(arch, c, layers)
        rope = _rope_parameters(arch, raw, types)
        if rope is None:
            return None
        gemma = arch.startswith("Gemma")
        return cls(
            architectures=(arch,),
            model_type=family["model_type"],
            vocab_size=int(c["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(c["intermediate_size"]),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(get("num_key_value_heads", heads)),
            head_dim=head_dim,
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(c["max_position_embeddings"]),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            attention_bias=bool(get("attention_bias", False)),
            mlp_bias=bool(get("mlp_bias", False)),
            rope_parameters=rope,
            sliding_window=None if window is None else int(window),
            use_sliding_window=slides,
            max_window_layers=int(get("max_window_layers", layers)),
            layer_types=None if types is None else tuple(types),
            eos_token_id=c.get("eos_token_id"),
            bos_token_id=c.get("bos_token_id"),
            query_pre_attn_scalar=c["query_pre_attn_scalar"] if gemma else None,
            attn_logit_softcapping=c["attn_logit_softcapping"] if gemma else None,
            final_logit_softcapping=c["final_logit_softcapping"] if gemma else None,
            hidden_activation=c.get("hidden_activation") if gemma else None,
            use_bidirectional_attention=c.get("use_bidirectional_attention"),
        )  # fmt: skip


def _gemma_layer_types(arch: str, c: dict[str, Any], layers: int) -> list[str] | None:
    """Gemma's local/global pattern where the config lists no layer types: every other layer local
    (Gemma 2), or five local to one global (Gemma 3, by ``sliding_window_pattern``)."""
    if arch == "Gemma2ForCausalLM":
        period = 2
    elif arch == "Gemma3ForCausalLM":
        period = int(c.get("sliding_window_pattern", 6))
    else:
        return None
    return ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(layers)]


def _rope_parameters(arch: str, raw: dict[str, Any], types: list[str] | None) -> dict[str, Any] | None:
    """The rope settings as the family's transformers class standardizes them, or None where they
    are not ours to read (a type the engine does not know, a required key missing)."""
    if arch == "Gemma3ForCausalLM":
        return _gemma3_rope(raw, types or [])
    rope = copy.deepcopy(raw.get("rope_scaling") or raw.get("rope_parameters") or {})
    if not isinstance(rope, dict) or any(isinstance(v, dict) for v in rope.values()):
        return None  # per-layer-type settings in a family without them
    rope.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    if arch == "Phi3ForCausalLM":
        rope.setdefault("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    elif raw.get("partial_rotary_factor") is not None:
        rope.setdefault("partial_rotary_factor", raw["partial_rotary_factor"])
    if not _standardize(rope, raw["max_position_embeddings"]):
        return None
    if arch == "Phi3ForCausalLM":
        if rope["rope_type"] not in ("default", "longrope"):
            return None  # Phi-3's class refuses other types ("su"/"yarn" configs lack what it needs)
        if rope["rope_type"] == "longrope":  # the class's own key wins over the rope dict's
            rope["original_max_position_embeddings"] = raw.get("original_max_position_embeddings", 4096)
        half = int(raw["hidden_size"] // raw["num_attention_heads"] * rope["partial_rotary_factor"]) // 2
        if any(len(rope.get(k) or [0] * half) != half for k in ("short_factor", "long_factor")):
            return None
    return rope if _complete(rope) else None


def _gemma3_rope(raw: dict[str, Any], types: list[str]) -> dict[str, Any] | None:
    """Gemma 3's settings per layer type: the global layers' (``rope_theta``, 1,000,000 by default,
    and any legacy ``rope_scaling``) and the local ones' (``rope_local_base_freq``, 10,000)."""
    rope = copy.deepcopy(raw.get("rope_parameters")) or {
        "sliding_attention": {"rope_type": "default"},
        "full_attention": {"rope_type": "default"},
    }
    if not isinstance(rope, dict) or not isinstance(rope.get("full_attention", {}), dict):
        return None
    if raw.get("rope_scaling") is not None:
        if "full_attention" not in rope:
            return None  # transformers' class fails on this one
        rope["full_attention"].update(raw["rope_scaling"])
    rope.setdefault("full_attention", {"rope_type": "default"})
    rope["full_attention"].setdefault("rope_theta", raw.get("rope_theta", 1_000_000.0))
    rope.setdefault("sliding_attention", {"rope_type": "default"})
    rope["sliding_attention"].setdefault("rope_theta", raw.get("rope_local_base_freq", 10_000.0))
    for kind in (k for k in rope if k in types):  # transformers standardizes the layer types it has
        if not isinstance(rope[kind], dict) or not _standardize(rope[kind], raw["max_position_embeddings"]):
            return None
        if not _complete(rope[kind]):
            return None
    if not all(isinstance(rope.get(k), dict) and "rope_type" in rope[k] for k in set(types)):
        return None
    return rope


def _standardize(rope: dict[str, Any], max_positions: int) -> bool:
    """The type named ``rope_type`` (legacy ``type``), and the original context where the type
    needs one; False for a type the engine does not know."""
    rope.setdefault("rope_type", rope.get("type", "default"))
    if rope["rope_type"] not in _ROPE_KEYS:
        return False
    if rope["rope_type"] in _CONTEXT_KEYED:
        rope.setdefault("original_max_position_embeddings", max_positions)
    return True


def _complete(rope: dict[str, Any]) -> bool:
    """Whether every key transformers requires of the type is there (it raises otherwise)."""
    return rope.get("rope_theta") is not None and all(k in rope for k in _ROPE_KEYS[rope["rope_type"]])


def read_model_config(folder: Path) -> Any:
    """The model's config: our record where it reads the whole of what the engine needs, else
    transformers' config object (the same attribute names)."""
    raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    lean = ModelConfig.from_dict(raw)
    if lean is not None:
        return lean
    from transformers import AutoConfig

    log.info("%s's config is read by transformers (%s)", folder.name, (raw.get("architectures") or ["?"])[0])
    return AutoConfig.from_pretrained(str(folder))
