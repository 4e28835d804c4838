"""A GGUF's config, generation config and tokenizer written as a Hugging Face folder, without weights.

A quantized engine reads its weights from the GGUF's own blocks (``model_weights``): what it needs
from a converted folder is only the model's config and tokenizer. transformers reads both from a
GGUF by parsing every metadata field (the 49k-token vocabulary and merges as numpy arrays, about
160 MiB in passing for SmolLM2), so this runs once per file in a child process: the engine's own
peak memory never holds that parse, and no float32 copy of the weights is ever written.

    python -m cachegw.backend.executor.gguf_meta FILE.gguf TARGET_DIR
"""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

from cachegw.backend.executor.gguf_table import string_field


def _read_metadata_once() -> None:
    """transformers parses the whole GGUF (every field as numpy arrays: tens of seconds on a busy
    machine) for the config, and again to choose the tokenizer's class: keep the first parse."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    if not hasattr(gguf_utils.load_gguf_checkpoint, "cache_info"):
        gguf_utils.load_gguf_checkpoint = functools.lru_cache(maxsize=2)(gguf_utils.load_gguf_checkpoint)


def fix_digit_splitting(tokenizer, pre: str | None) -> None:
    """transformers builds a plain ByteLevel pre-tokenizer from SmolLM's GGUF; SmolLM splits digits
    one by one first. Without this fix numbers and long texts tokenize unlike llama.cpp/HF."""
    if pre != "smollm":
        return
    from tokenizers import pre_tokenizers

    backend = tokenizer.backend_tokenizer
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), backend.pre_tokenizer]
    )


def load_tokenizer(gguf_path: Path):
    """The GGUF's tokenizer as transformers builds it, with SmolLM's digit splitting restored."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    fix_digit_splitting(tokenizer, string_field(gguf_path, "tokenizer.ggml.pre"))
    return tokenizer


def write_model_files(gguf_path: Path, target: Path) -> None:
    """config.json, generation_config.json and the tokenizer's files in ``target`` (no weights)."""
    from transformers import AutoConfig, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    _read_metadata_once()
    config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are read from the file's blocks, not by transformers
    # what a converted model's config says (the engine reads the architecture from it)
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    config.dtype = "float32"
    target.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(target))
    GenerationConfig.from_model_config(config).save_pretrained(str(target))
    load_tokenizer(gguf_path).save_pretrained(str(target))


def write_in_child(gguf_path: Path, target: Path) -> None:
    """``write_model_files`` in a child process, so its passing memory never counts against ours."""
    cmd = [sys.executable, "-m", "cachegw.backend.executor.gguf_meta", str(gguf_path), str(target)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"reading {gguf_path.name}'s config and tokenizer failed:\n{done.stderr[-2000:]}")


if __name__ == "__main__":
    write_model_files(Path(sys.argv[1]), Path(sys.argv[2]))
