"""Which model class runs a checkpoint: by its config's ``architectures``, or a GGUF's
``general.architecture`` (what llama.cpp's converter names each family).

Also where a setting a family cannot honour is refused at start-up, with the reason, rather than
ignored: latent attention (DeepSeek) keeps one latent row per token, which the int8/fp8 cache rows,
the weight-only int4/int8 layers (built for Llama's fused projections), attention sinks and H2O's
scored attention do not know, and its projections (and mixture-of-experts layers) are not the ones
LoRA slots wrap.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from cachegw.backend.config import EngineConfig
from cachegw.backend.executor.models.deepseek import DEEPSEEK_ARCHITECTURES, DeepseekForCausalLM, MLASpec
from cachegw.backend.executor.models.gemma import GemmaForCausalLM
from cachegw.backend.executor.models.llama import LlamaForCausalLM, ModelSpec, architecture
from cachegw.backend.executor.models.phi3 import Phi3ForCausalLM
from cachegw.backend.executor.models.qwen3 import Qwen3ForCausalLM

log = logging.getLogger("cachegw.backend")


@dataclass(frozen=True)
class Family:
    model: type[LlamaForCausalLM]
    gguf_architectures: tuple[str, ...]  # the names llama.cpp's converter gives this family's files
    # a GGUF's float tensors and projections load straight into the model (``model_weights.py``,
    # names by ``gguf_weights.hf_name``; Phi-3's fused projections split by ``gguf_weights.split_fused``)
    gguf_direct: bool = True


FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family(LlamaForCausalLM, ("llama",)),
    "MistralForCausalLM": Family(LlamaForCausalLM, ("llama", "mistral")),
    "Qwen2ForCausalLM": Family(LlamaForCausalLM, ("qwen2",)),
    "Qwen3ForCausalLM": Family(Qwen3ForCausalLM, ("qwen3",)),
    "Gemma2ForCausalLM": Family(GemmaForCausalLM, ("gemma2",)),
    "Gemma3ForCausalLM": Family(GemmaForCausalLM, ("gemma3",)),
    "Phi3ForCausalLM": Family(Phi3ForCausalLM, ("phi3",)),
    # latent attention: safetensors folders only (refused below for a GGUF)
    **{arch: Family(DeepseekForCausalLM, (), gguf_direct=False) for arch in DEEPSEEK_ARCHITECTURES},
}


def family(hf_config) -> Family:
    """The family of a config, or a ValueError naming the supported ones."""
    arch = architecture(hf_config)
    if arch not in FAMILIES:
        hint = " (load the text model: Gemma3ForCausalLM)" if arch == "Gemma3ForConditionalGeneration" else ""
        raise ValueError(f"unsupported architecture {arch}{hint}; supported: {', '.join(FAMILIES)}")
    return FAMILIES[arch]


def check_gguf(kind: Family, architecture: str, path: str) -> None:
    """A GGUF of another family than its converted config says is refused (a mixed-up cache)."""
    if architecture not in kind.gguf_architectures:
        expected = " or ".join(kind.gguf_architectures)
        raise ValueError(f"{path} is a {architecture!r} GGUF; this model's config wants {expected}")


def model_spec(hf_config, config: EngineConfig, gguf: Path | None = None) -> ModelSpec:
    """The model's shape, or a ValueError naming what cannot run (the architecture, or a setting)."""
    family(hf_config)
    arch = architecture(hf_config)
    if arch not in DEEPSEEK_ARCHITECTURES:
        return ModelSpec.from_hf_config(hf_config)
    refused = {
        "kv_cache_dtype": config.kv_cache_dtype != "auto",
        "quantization": config.quantization in ("int4", "int8"),
        "attention_sinks": bool(config.attention_sinks),
        "kv_eviction": config.kv_eviction != "none",  # H2O's scored path is per-head K/V attention
        "max_loras": config.max_loras > 0,  # LoRA slots wrap Llama's projections, which MLA/MoE lack
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
