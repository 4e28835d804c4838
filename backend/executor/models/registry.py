"""Which model class runs a checkpoint, read from its Hugging Face config's architecture.

Also where a setting a family cannot honour is refused at start-up, with the reason, rather than
ignored: latent attention (DeepSeek) keeps one latent row per token, which the int8/fp8 cache rows,
the weight-only int4/int8 layers (built for Llama's fused projections) and attention sinks do not
know.
"""

from __future__ import annotations

import logging
from pathlib import Path

from cachegw.backend.config import EngineConfig
from cachegw.backend.executor.models.deepseek import DEEPSEEK_ARCHITECTURES, DeepseekForCausalLM, MLASpec
from cachegw.backend.executor.models.llama import SUPPORTED_ARCHITECTURES, LlamaForCausalLM, ModelSpec

log = logging.getLogger("cachegw.backend")
ARCHITECTURES = (*SUPPORTED_ARCHITECTURES, *DEEPSEEK_ARCHITECTURES)


def model_spec(hf_config, config: EngineConfig, gguf: Path | None = None) -> ModelSpec:
    """The model's shape, or a ValueError naming what cannot run (the architecture, or a setting)."""
    arch = (getattr(hf_config, "architectures", None) or ["LlamaForCausalLM"])[0]
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch}; supported: {', '.join(ARCHITECTURES)}")
    if arch not in DEEPSEEK_ARCHITECTURES:
        return ModelSpec.from_hf_config(hf_config)
    refused = {
        "kv_cache_dtype": config.kv_cache_dtype != "auto",
        "quantization": config.quantization in ("int4", "int8"),
        "attention_sinks": bool(config.attention_sinks),
        "kv_eviction": config.kv_eviction != "none",  # H2O's scored path is per-head K/V attention
    }
    names = [f"{key}={getattr(config, key)!r}" for key, bad in refused.items() if bad]
    if gguf is not None and config.load_format != "dummy":
        names.append(f"a GGUF file ({gguf.name})")
    if names:
        raise ValueError(
            f"{arch} uses latent attention (MLA), which cachegw runs with float weights from a safetensors "
            f"folder and a float KV cache only: {', '.join(names)} cannot be used with it"
        )
    spec = MLASpec.from_hf_config(hf_config)
    if not spec.decode_compiles and config.compile != "off":
        log.info(
            "%s has mixture-of-experts layers: compile=%r does not apply, decoding eagerly",
            arch,
            config.compile,
        )
    return spec


def model_class(spec: ModelSpec) -> type[LlamaForCausalLM]:
    return DeepseekForCausalLM if isinstance(spec, MLASpec) else LlamaForCausalLM
