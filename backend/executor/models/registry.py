"""Which model class runs a checkpoint: by its config's ``architectures``, or a GGUF's
``general.architecture`` (what llama.cpp's converter names each family)."""

from __future__ import annotations

from dataclasses import dataclass

from cachegw.backend.executor.models.gemma import GemmaForCausalLM
from cachegw.backend.executor.models.llama import LlamaForCausalLM, ModelSpec, architecture
from cachegw.backend.executor.models.phi3 import Phi3ForCausalLM
from cachegw.backend.executor.models.qwen3 import Qwen3ForCausalLM


@dataclass(frozen=True)
class Family:
    model: type[LlamaForCausalLM]
    gguf_architecture: str
    # a GGUF's projections load straight into the quantized layers (``model_weights.py``): the file
    # names each of them as Llama's do; Phi-3's fused ones are dequantized through transformers
    gguf_direct: bool = True


FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family(LlamaForCausalLM, "llama"),
    "MistralForCausalLM": Family(LlamaForCausalLM, "llama"),
    "Qwen2ForCausalLM": Family(LlamaForCausalLM, "qwen2"),
    "Qwen3ForCausalLM": Family(Qwen3ForCausalLM, "qwen3"),
    "Gemma2ForCausalLM": Family(GemmaForCausalLM, "gemma2"),
    "Gemma3ForCausalLM": Family(GemmaForCausalLM, "gemma3"),
    "Phi3ForCausalLM": Family(Phi3ForCausalLM, "phi3", gguf_direct=False),
}


def family(hf_config) -> Family:
    """The family of a config, or a ValueError naming the supported ones."""
    arch = architecture(hf_config)
    if arch not in FAMILIES:
        hint = " (load the text model: Gemma3ForCausalLM)" if arch == "Gemma3ForConditionalGeneration" else ""
        raise ValueError(f"unsupported architecture {arch}{hint}; supported: {', '.join(FAMILIES)}")
    return FAMILIES[arch]


def model_spec(hf_config) -> ModelSpec:
    """The model's shape, once its architecture is known to load."""
    family(hf_config)
    return ModelSpec.from_hf_config(hf_config)
