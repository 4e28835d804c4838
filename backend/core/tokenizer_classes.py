"""What transformers' own tokenizer classes make of a folder's tokenizer.json, done on the Rust tokenizer.

transformers 5 reads a folder with the class ``AutoTokenizer`` picks from ``tokenizer_config.json``'s
name and the model's type (``chosen_class``: a Qwen2 model naming the generic class gets Qwen2's, a
Phi-3 or Mistral folder naming Llama's gets the generic one, as does a byte-level file under Llama's
name). A model's own class (``Qwen2Tokenizer`` for Qwen2/2.5/3, ``GemmaTokenizer`` for Gemma 1-3,
``LlamaTokenizer`` for Llama 2-style sentencepiece folders) takes only the BPE vocabulary and merges
from ``tokenizer.json`` and builds everything else as it defines it: normalizer, pre-tokenizer,
decoder and BPE settings (a Qwen GGUF's file has no NFC normalizer, the class adds one), and its
default special tokens where the config names none. ``TokenizerClass.rebuild`` does the same to the
tokenizer read from the file. For every class, transformers drops ``add_bos_token``/``add_eos_token``
from the config of a folder with a tokenizer.json (the file's post-processor decides:
``post_processor``), ignores ``clean_up_tokenization_spaces`` after a BPE model, and makes each named
special token a special added token (``tokenizer.py``).

Any class or setting not handled here stays transformers' to read (``tokenizer.py``);
``tests/test_lean_tokenizer_classes.py`` compares both readings on a corpus for each class here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenizers import Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as RustTokenizer

# Qwen2's pre-tokenizer split (contractions, letter runs, single digits, punctuation runs, newlines, spaces)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPACE = "\u2581"  # sentencepiece's visible space


def _bpe(rust: RustTokenizer, **settings: Any) -> None:
    """The file's vocabulary and merges with the class's BPE settings (each one the class fixes)."""
    model = rust.model
    every = dict(dropout=None, unk_token=None, continuing_subword_prefix=None, end_of_word_suffix=None,
                 fuse_unk=False, byte_fallback=False, ignore_merges=False)  # fmt: skip
    for name, value in {**every, **settings}.items():
        setattr(model, name, value)


def _spm_decoder(strip_prefix: bool) -> decoders.Decoder:
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    return decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1)] if strip_prefix else []))


def _qwen2(rust: RustTokenizer, config: dict) -> None:
    _bpe(rust, continuing_subword_prefix="", end_of_word_suffix="")
    split = pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False)
    prefix = bool(config.get("add_prefix_space") or False)
    rust.normalizer = normalizers.NFC()
    rust.pre_tokenizer = pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(prefix, use_regex=False)])
    rust.decoder = decoders.ByteLevel()


def _gemma(rust: RustTokenizer, config: dict) -> None:
    unk = config.get("unk_token", "<unk>")  # the class spells a missing one "None", as transformers does
    _bpe(
        rust,
        unk_token=str(unk.get("content") if isinstance(unk, dict) else unk),
        fuse_unk=True,
        byte_fallback=True,
    )
    rust.normalizer = normalizers.Replace(" ", _SPACE)
    rust.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous", invert=False)
    rust.decoder = _spm_decoder(False)


def _llama(rust: RustTokenizer, config: dict) -> None:
    _bpe(rust, fuse_unk=True, byte_fallback=True)
    prefix = config.get("add_prefix_space")
    prefix = True if prefix is None else bool(prefix)
    scheme = ("always" if config.get("legacy") else "first") if prefix else "never"
    rust.normalizer = None
    rust.pre_tokenizer = pre_tokenizers.Metaspace(replacement=_SPACE, prepend_scheme=scheme, split=False)
    rust.decoder = _spm_decoder(prefix)


@dataclass(frozen=True)
class TokenizerClass:
    """One of transformers' classes: its default special tokens and how it rebuilds the pipeline."""

    defaults: dict[str, str | None]
    rebuild: Callable[[RustTokenizer, dict], None]


_ENDOFTEXT = "<|endoftext|>"
CLASSES: dict[str, TokenizerClass] = {
    "Qwen2Tokenizer": TokenizerClass(
        {"unk_token": _ENDOFTEXT, "bos_token": None, "eos_token": _ENDOFTEXT, "pad_token": _ENDOFTEXT}, _qwen2
    ),
    "GemmaTokenizer": TokenizerClass(
        {
            "unk_token": "<unk>",
            "bos_token": "<bos>",
            "eos_token": "<eos>",
            "pad_token": "<pad>",
            "mask_token": "<mask>",
        },
        _gemma,
    ),  # fmt: skip
    "LlamaTokenizer": TokenizerClass({"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}, _llama),
}
for _old, _new in (("Qwen2TokenizerFast", "Qwen2Tokenizer"), ("GemmaTokenizerFast", "GemmaTokenizer"),
                   ("LlamaTokenizerFast", "LlamaTokenizer")):  # fmt: skip
    CLASSES[_old] = CLASSES[_new]


# transformers' AutoTokenizer picks the class from the model's type as well as the config's name: each
# type the engine serves, with the class transformers registers for it and whether it distrusts the
# class a folder names (``tests/test_lean_tokenizer_classes.py`` checks this against transformers)
MODEL_TYPES: dict[str, tuple[str | None, bool]] = {
    "llama": (None, False),
    "mistral": ("TokenizersBackend", False),
    "qwen2": ("Qwen2Tokenizer", True),
    "qwen3": ("Qwen2Tokenizer", False),
    "gemma": ("GemmaTokenizer", False),
    "gemma2": ("GemmaTokenizer", False),
    "gemma3": ("GemmaTokenizer", False),
    "gemma3_text": ("GemmaTokenizer", False),
    "phi3": ("TokenizersBackend", True),
}
GENERIC = {"TokenizersBackend", "PreTrainedTokenizerFast"}


def chosen_class(named: str, model_type: str | None, byte_level: Callable[[], bool]) -> str | None:
    """The class AutoTokenizer reads the folder with (``named`` in tokenizer_config.json), or None
    where the model's type is not one we know transformers' choice for."""
    if model_type not in MODEL_TYPES:
        return None
    registered, distrusted = MODEL_TYPES[model_type]
    base = named.removesuffix("Fast")
    if base == "LlamaTokenizer" and not distrusted and byte_level():
        return "TokenizersBackend"  # a Llama-3-style byte-level file under Llama 2's class name
    if registered is not None and registered != base:
        if registered in GENERIC:
            return "TokenizersBackend"
        return registered if distrusted else named
    return named


def post_processor(rust: RustTokenizer) -> None:
    """transformers drops ``add_bos_token``/``add_eos_token`` from the config of a folder with a
    tokenizer.json (the file's post-processor decides), and gives a file without one a template that
    adds nothing."""
    if rust.post_processor is None:
        rust.post_processor = processors.TemplateProcessing(
            single="$A:0", pair="$A:0 $B:1", special_tokens=[]
        )
