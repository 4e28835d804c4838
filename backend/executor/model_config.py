"""The model's config.json as our own record: transformers' config classes stay out of the serving process.

Importing transformers' ``AutoConfig`` pulls in its model-loading stack (torch.distributed's tensor
ops among it): 61 MiB of a serving process to read one JSON file. The Llama-shaped families whose
settings ``ModelSpec`` reads in full (Llama, Mistral, Qwen2, Qwen3) with an unscaled rope are read
here, each missing key given the default transformers' class of that family gives it; the other
families (Gemma's and Phi-3's many defaults, DeepSeek's mixture of experts) and scaled ropes (whose
frequencies transformers' initialisers compute from its own config object) are read by transformers,
as before (``read_model_config``). ``tests/test_lean_tokenizer.py`` checks that both readings give
the same ``ModelSpec``, rope and stop tokens.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("cachegw.backend")

# Each family's defaults where transformers' config class differs from Llama's (the class defaults
# a config.json may leave out).
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {},
    "MistralForCausalLM": {"sliding_window": 4096},
    "Qwen2ForCausalLM": {"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28},
    "Qwen3ForCausalLM": {"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28},
}
# Keys whose class default is the family's size, not a shape we should guess.
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "max_position_embeddings")  # fmt: skip


@dataclass(frozen=True)
class ModelConfig:
    """What the engine reads of a Llama-shaped model's config (names as in config.json)."""

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
    rope_scaling: None = field(default=None)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig | None:
        """The record, or None where transformers should read the config (see the module's doc)."""
        arch = (raw.get("architectures") or ["LlamaForCausalLM"])[0]
        if arch not in _FAMILY_DEFAULTS or any(raw.get(k) is None for k in _REQUIRED):
            return None
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default" or "full_attention" in rope:
            return None
        if raw.get("num_key_value_heads") is None and arch != "LlamaForCausalLM":
            return None  # Mistral's and Qwen's classes default to a count of their own
        c = {**_FAMILY_DEFAULTS[arch], **raw}

        def get(key: str, default: Any) -> Any:
            return default if c.get(key) is None else c[key]

        heads, layers = int(c["num_attention_heads"]), int(c["num_hidden_layers"])
        theta = float(rope.get("rope_theta", get("rope_theta", 1e4)))
        slides = bool(get("use_sliding_window", True))
        window = c.get("sliding_window") if slides or not arch.startswith("Qwen") else None  # Qwen's class
        types = c.get("layer_types")
        return cls(
            architectures=(arch,),
            model_type=str(get("model_type", "llama")),
            vocab_size=int(c["vocab_size"]),
            hidden_size=int(c["hidden_size"]),
            intermediate_size=int(c["intermediate_size"]),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(get("num_key_value_heads", heads)),
            head_dim=int(get("head_dim", int(c["hidden_size"]) // heads)),
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(c["max_position_embeddings"]),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            attention_bias=bool(get("attention_bias", False)),
            mlp_bias=bool(get("mlp_bias", False)),
            rope_parameters={"rope_type": "default", "rope_theta": theta},
            sliding_window=None if window is None else int(window),
            use_sliding_window=slides,
            max_window_layers=int(get("max_window_layers", layers)),
            layer_types=None if types is None else tuple(types),
            eos_token_id=c.get("eos_token_id"),
            bos_token_id=c.get("bos_token_id"),
        )  # fmt: skip


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
