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
    gguf_architectures: tuple[str, ...]  # the names llama.cpp's converter gives this family's files
    # a GGUF's float tensors and projections load straight into the model (``model_weights.py``,
    # names by ``gguf_weights.hf_name``). Phi-3's fused projections are read through transformers'
    # dequantizing converter instead.
    gguf_direct: bool = True


FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family(LlamaForCausalLM, ("llama",)),
    "MistralForCausalLM": Family(LlamaForCausalLM, ("llama", "mistral")),
    "Qwen2ForCausalLM": Family(LlamaForCausalLM, ("qwen2",)),
    "Qwen3ForCausalLM": Family(Qwen3ForCausalLM, ("qwen3",)),
    "Gemma2ForCausalLM": Family(GemmaForCausalLM, ("gemma2",)),
    "Gemma3ForCausalLM": Family(GemmaForCausalLM, ("gemma3",)),
    "Phi3ForCausalLM": Family(Phi3ForCausalLM, ("phi3",), gguf_direct=False),
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


def model_spec(hf_config) -> ModelSpec:
    """The model's shape, once its architecture is known to load."""
    family(hf_config)
    return ModelSpec.from_hf_config(hf_config)
