"""A small Llama with seeded random weights, saved as safetensors by transformers: a model for checks
that must run where no model file can go (the lent GPU machine takes 64 MiB, the embedded GGUF is
98 MB), read by our engine and by Hugging Face alike (bench/gpu_parity.py, tests/test_triton_engine.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class LlamaShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int


def save_random_llama(folder: Path, shape: LlamaShape, seed: int = 0, max_positions: int = 1024) -> Path:
    """float32 weights at a larger init than training uses (0.05), so greedy picks are decisive; no
    tokenizer (prompts go in as token ids); untied embeddings, so the LM head is its own weight."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=max_positions,
        initializer_range=0.05,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)  # float32: torch's default dtype
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


SPECIAL = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2: the config's pad, bos and eos


def save_byte_tokenizer(folder: Path, vocab: int) -> Path:
    """A byte-level BPE tokenizer of exactly ``vocab`` ids beside a random Llama, written by the
    ``tokenizers`` library alone (no file has to travel to a GPU machine): the three special tokens,
    the 256 bytes, then merged pairs of ASCII letters, digits and the space until the vocabulary is
    full. Every id decodes to text, so stop strings, drafts and structured output (whose grammar needs
    a tokenizer) run on the random model."""
    import json

    from tokenizers import AddedToken, Tokenizer, decoders, models
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet())
    ids = {token: i for i, token in enumerate((*SPECIAL, *alphabet))}
    common = [c for c in alphabet if c.isascii() and c.isalnum()] + ["\u0120"]  # Ġ: the space
    merges = [(a, b) for a in common for b in common][: max(0, vocab - len(ids))]
    ids |= {a + b: len(ids) + i for i, (a, b) in enumerate(merges)}
    if len(ids) != vocab:
        raise ValueError(f"a byte tokenizer has {len(SPECIAL) + 256} to {len(ids)} ids, not {vocab}")
    tokenizer = Tokenizer(models.BPE(ids, merges))
    tokenizer.pre_tokenizer = ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tokenizer.save(str(folder / "tokenizer.json"))
    names = dict(zip(("pad_token", "bos_token", "eos_token"), SPECIAL, strict=True))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **names}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    return folder


# The tiny model of the KV tier and event tests: 2 layers, 2 KV heads of 16, loads in well under a second.
TINY = LlamaShape(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=256)
TINY_BLOCK = 8  # tokens per KV block in those tests


def tiny_llm(model_dir: str, kv_cache_tokens: int, **engine: object) -> Any:
    """An offline ``LLM`` on the tiny model (float32, CPU, 8-token blocks); ``engine``: any [engine] key."""
    from cachegw.backend import LLM

    return LLM(
        model=model_dir, dtype="float32", device="cpu", block_size=TINY_BLOCK,
        kv_cache_tokens=kv_cache_tokens, **engine,
    )  # fmt: skip


def tiny_greedy(model_dir: str, kv_cache_tokens: int, prompt: list[int], params: Any) -> list[int]:
    """``prompt``'s continuation on a fresh engine with no tier, freed at once: the reference a tier test
    compares its restored KV against."""
    import gc

    llm = tiny_llm(model_dir, kv_cache_tokens)
    out = list(llm.generate(prompt, params)[0].outputs[0].token_ids)
    del llm
    gc.collect()
    return out
