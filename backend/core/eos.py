"""Which token ids end a sequence: the generation config's (else the model config's) and the tokenizer's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def eos_token_ids(model_dir: Path, hf_config: Any, tokenizer: Any) -> set[int]:
    """Every id the model was trained to stop at; a model may list several (Llama 3's <|eot_id|>).
    generation_config.json is read as JSON (transformers' GenerationConfig reads the same key)."""
    ids: set[int] = set()
    path = Path(model_dir) / "generation_config.json"
    if path.exists():
        eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    else:
        eos = getattr(hf_config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
