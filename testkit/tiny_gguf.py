"""A tiny GGUF written from a transformers model with gguf's own writer: tensor names from gguf's
name map (llama.cpp's, so Q/K rows stay as they are for every architecture but Llama's), the
projections as Q8_0 blocks and the rest float32, and a small byte-level BPE tokenizer, so that both
transformers' GGUF reader and the engine's direct loader can read it. Tests of GGUF loading need no
downloaded file this way."""

from __future__ import annotations

from pathlib import Path

_ARCHS = {"qwen3": "QWEN3", "qwen2": "QWEN2", "gemma2": "GEMMA2", "gemma3": "GEMMA3", "phi3": "PHI3"}
# Phi-3 keeps its fused ones (llama.cpp's attn_qkv, and ffn_up holding gate and up)
_PROJECTIONS = frozenset(
    ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj"]
)


def _byte_symbols() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes (its byte-level BPE alphabet)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    table = {b: chr(b) if b in keep else chr(next(extra)) for b in range(256)}
    return [table[b] for b in range(256)]


def _tokenizer(vocab: int) -> tuple[list[str], list[str]]:
    """``vocab`` tokens: the 256 bytes, then pairs of letters, each with its merge."""
    tokens = _byte_symbols()
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    merges: list[str] = []
    for a in letters:
        for b in letters:
            if len(tokens) == vocab:
                return tokens, merges
            tokens.append(a + b)
            merges.append(f"{a} {b}")
    raise ValueError(f"vocab {vocab} is more than this tokenizer makes")


def write_tiny_gguf(model, path: Path, arch: str = "qwen3", chat_template: str | None = None) -> Path:
    """``model``: a transformers causal LM of ``arch`` (qwen2/3, gemma2/3, phi3) with a vocabulary of
    256-932 tokens, and dimensions that are multiples of 32 (Q8_0 blocks). Gemma's settings that
    transformers' GGUF reader does not take (soft-caps, query scale, local rope base) are its
    config defaults, so the model should keep them. ``chat_template``: the file's, if any."""
    import gguf
    import numpy as np
    from gguf.quants import quantize

    config = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = config.rope_parameters
    writer.add_rope_freq_base((rope.get("full_attention") or rope)["rope_theta"])
    gemma = arch.startswith("gemma")
    if gemma:
        writer.add_sliding_window(config.sliding_window)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    tokens, merges = _tokenizer(config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * len(tokens))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)  # Phi-3's config would otherwise keep its 32000, past a tiny vocabulary
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, _ARCHS[arch]), config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # llama.cpp's files hold a tied head once, as the embedding
        base, suffix = name.rsplit(".", 1)
        target = names.get_name(base)
        if target is None:
            raise KeyError(f"no GGUF name for {name}")
        data = tensor.detach().float().numpy()
        if gemma and base.endswith("norm"):
            data = data + 1.0  # llama.cpp stores Gemma's zero-centred norm weights as 1 + w
        if base.split(".")[-1] in _PROJECTIONS:
            blocks = quantize(data, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(f"{target}.{suffix}", blocks, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(f"{target}.{suffix}", np.ascontiguousarray(data, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# Tokens a chat model's vocabulary marks as control (whole, special) and user-defined (whole, plain).
_CHAT_TOKENS = {
    "bpe": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    "spm": ["<start_of_turn>", "<end_of_turn>"],
}
_SPM_PIECES = [
    *("\u2581", "\u2581\u2581", "he", "ll", "llo", "\u2581he", "\u2581hello", "\u2581world", "or", "ld"),
    *("\u2581the", "in", "ing", "\u2581a", "é", "ü", "中", "\u2581int", "\u2581def", "\u2581return"),
]


def write_tokenizer_gguf(path: Path, arch: str, kind: str, chat_template: str | None = None) -> Path:
    """A GGUF of one small model's shape with its tokenizer only (no tensors): what transformers reads
    to write a converted folder's config and tokenizer. ``kind`` "bpe": the byte-level vocabulary of
    ``write_tiny_gguf`` with Qwen's chat tokens and a user-defined ``<think>``; "spm": a sentencepiece
    vocabulary as Gemma's and Llama's files hold one (``<0xNN>`` byte tokens, ``▁`` for spaces, scores
    in merge order, no merges, BOS added)."""
    import gguf

    types = gguf.TokenType
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(256)
    writer.add_embedding_length(256)
    writer.add_feed_forward_length(512)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_key_length(128)
    writer.add_value_length(128)
    writer.add_rope_dimension_count(128)
    writer.add_layer_norm_rms_eps(1e-6)
    if arch.startswith("gemma"):
        writer.add_sliding_window(16)
    if kind == "bpe":
        tokens, merges = _tokenizer(400)
        kinds = [types.NORMAL] * len(tokens)
        tokens += [*_CHAT_TOKENS["bpe"], "<think>"]
        kinds += [types.CONTROL] * 3 + [types.USER_DEFINED]
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2")
        writer.add_token_merges(merges)
        writer.add_bos_token_id(tokens.index("<|endoftext|>"))
        writer.add_eos_token_id(tokens.index("<|im_end|>"))
        writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    else:
        tokens = ["<pad>", "<eos>", "<bos>", "<unk>", *_CHAT_TOKENS["spm"]]
        kinds = [types.CONTROL, types.CONTROL, types.CONTROL, types.UNKNOWN, types.CONTROL, types.CONTROL]
        tokens += [f"<0x{b:02X}>" for b in range(256)]
        kinds += [types.BYTE] * 256
        letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + list(
            "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,:!?'\"()"
        )
        pieces = list(dict.fromkeys([*letters, *_SPM_PIECES, *("\u2581" + c for c in letters[:26])]))
        tokens += pieces
        kinds += [types.NORMAL] * len(pieces)
        writer.add_tokenizer_model("llama")
        writer.add_token_scores([0.0] * (len(tokens) - len(pieces)) + [-float(i) for i in range(len(pieces))])
        writer.add_bos_token_id(2)
        writer.add_eos_token_id(1)
        writer.add_unk_token_id(3)
        writer.add_pad_token_id(0)
        writer.add_add_bos_token(True)
    writer.add_token_list(tokens)
    writer.add_token_types(kinds)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
