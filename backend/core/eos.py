"""Which token ids end a sequence: the generation config's (else the model config's) and the tokenizer's."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def eos_token_ids(model_dir: Path, hf_config: Any, tokenizer: Any) -> set[int]:
    """Every id the model was trained to stop at; a model may list several (Llama 3's <|eot_id|>)."""
    from transformers import GenerationConfig

    ids: set[int] = set()
    try:
        eos = GenerationConfig.from_pretrained(str(model_dir)).eos_token_id
    except OSError:
        eos = getattr(hf_config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
