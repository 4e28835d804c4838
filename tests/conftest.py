"""Shared fixtures: the real engine on the real embedded SmolLM2, loaded once per session."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def llm():
    """float32 (what parity needs) with a roomy KV cache."""
    from backend import LLM

    return LLM(dtype="float32", kv_cache_tokens=16384, max_num_seqs=16)


@pytest.fixture(scope="session")
def hf_model(llm):
    """Hugging Face's own Llama on the very same converted weights: the parity reference."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(llm.engine.model_dir), dtype=torch.float32).eval()
