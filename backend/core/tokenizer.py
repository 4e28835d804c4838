"""The model's tokenizer on the `tokenizers` library alone: transformers stays out of the serving process.

transformers' fast tokenizer is a wrapper over the same Rust tokenizer; importing it (and the config
classes beside it) costs the engine about 135 MiB of its 573. A folder with a ``tokenizer.json`` is
read here when the class AutoTokenizer would pick for it is the generic one (what transformers
writes for the embedded model and for Llama and Phi-3 GGUFs) or one whose rebuild of the file's
pipeline ``tokenizer_classes.py`` repeats (Qwen2's for Qwen2/3, Gemma's, Llama 2's): the Rust
tokenizer from the file, the added tokens the config lists beside it, the named and extra special
tokens, the chat template (rendered by ``chat_template.py``). Anything else (another class, remote
code, a ``tokenizer.model`` only, special tokens split as text, clean-up after a WordPiece or
Unigram model, a default special token the vocabulary lacks) is transformers' ``AutoTokenizer``, as
before: ``open_tokenizer``.

Only what the engine, the server, the tool prompts and structured output use is here, with
transformers' names and results (``tests/test_lean_tokenizer.py`` and ``test_lean_tokenizer_classes.py``
compare them on a corpus). The
Rust tokenizer is never changed after loading, so threads may share it; the server takes a ``fork``
(its own chat template, the same Rust tokenizer) rather than a second copy.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as RustTokenizer
from tokenizers.models import BPE

from cachegw.backend.core.tokenizer_classes import CLASSES, GENERIC, chosen_class, post_processor
from cachegw.backend.executor.host_memory import release_free_heap

log = logging.getLogger("cachegw.backend")

# transformers' named special tokens, in its order (``special_tokens_map``, ``all_special_tokens``)
NAMED = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_ADDED_FIELDS = ("single_word", "lstrip", "rstrip", "normalized")
# tokenizer_config.json settings by which transformers changes the file's tokenizer in ways not done here
_REWRITES = (
    "split_special_tokens",
    "fix_mistral_regex",
    "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output",
)


def _text(token: Any) -> str | None:
    """A special token's text in tokenizer_config.json (a string, or an AddedToken's dict)."""
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) else None


def _chat_template(folder: Path, config: dict) -> str | dict[str, str] | None:
    path = folder / "chat_template.jinja"
    if path.exists():
        return path.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # several named templates
        return {t["name"]: t["template"] for t in template}
    return template


def _model_type(folder: Path) -> str | None:
    path = folder / "config.json"
    return json.loads(path.read_text(encoding="utf-8")).get("model_type") if path.exists() else None


class Tokenizer:
    """encode/decode, token ids and texts, special tokens and the chat template of one model."""

    def __init__(self, rust: RustTokenizer, config: dict, template: str | dict[str, str] | None) -> None:
        self.backend_tokenizer = rust
        self.chat_template = template
        self.special_tokens_map = {k: t for k in NAMED if (t := _text(config.get(k))) is not None}
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        extra = list(extra.values()) if isinstance(extra, dict) else list(extra)
        named = list(dict.fromkeys(self.special_tokens_map.values()))
        self.all_special_tokens = named + [t for t in map(_text, extra) if t is not None and t not in named]

    @classmethod
    def read(cls, folder: Path) -> Tokenizer | None:
        """The folder's tokenizer, or None where only transformers reads it as it should be read."""
        path, config_path = folder / "tokenizer.json", folder / "tokenizer_config.json"
        if not path.exists() or (folder / "additional_chat_templates").exists():
            return None
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.exists() else {}
        named, model = config.get("tokenizer_class"), _model_type(folder)
        if not isinstance(named, str) or "auto_map" in config or any(config.get(k) for k in _REWRITES):
            return None
        name = chosen_class(named, model, lambda: '"ByteLevel"' in path.read_text(encoding="utf-8"))
        own = CLASSES.get(name) if name is not None else None
        if name not in GENERIC and own is None:
            return None
        rust = RustTokenizer.from_file(str(path))
        if own is not None:
            if not isinstance(rust.model, BPE):  # the classes here rebuild a BPE model only
                return None
            own.rebuild(rust, config)
            config = {**own.defaults, **config}
        if config.get("clean_up_tokenization_spaces") and not isinstance(rust.model, BPE):
            return None  # transformers cleans up only after a WordPiece or Unigram model
        rust.no_truncation()
        rust.no_padding()
        listed = config.get("added_tokens_decoder") or {}
        for _, token in sorted(listed.items(), key=lambda kv: int(kv[0])):
            if rust.token_to_id(token["content"]) is None:  # transformers adds what the file lacks
                fields = {k: token[k] for k in _ADDED_FIELDS if k in token}
                added = AddedToken(token["content"], special=bool(token.get("special")), **fields)
                (rust.add_special_tokens if token.get("special") else rust.add_tokens)([added])
        tokenizer = cls(rust, config, _chat_template(folder, config))
        if any(rust.token_to_id(t) is None for t in tokenizer.all_special_tokens):
            return None
        whole = {t.content for t in rust.get_added_tokens_decoder().values()}
        for token in tokenizer.all_special_tokens:  # transformers makes each one a special added token
            if token not in whole:
                rust.add_special_tokens([AddedToken(token, special=True, normalized=False)])
        post_processor(rust)
        return tokenizer

    def fork(self) -> Tokenizer:
        """A tokenizer for another thread: its own attributes, the same (unchanging) Rust tokenizer."""
        return copy.copy(self)

    # --- ids and text ------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text, add_special_tokens)}

    def decode(self, ids: int | list[int], skip_special_tokens: bool = False) -> str:
        ids = [ids] if isinstance(ids, int) else list(ids)
        return self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: int | list[int]) -> Any:
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(i) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> Any:
        if isinstance(tokens, str):
            found = self.backend_tokenizer.token_to_id(tokens)
            return self.unk_token_id if found is None else found
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def _id(self, name: str) -> int | None:
        token = self.special_tokens_map.get(name)
        return None if token is None else self.backend_tokenizer.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        return self._id("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._id("bos_token")

    @property
    def unk_token_id(self) -> int | None:
        return self._id("unk_token")

    @property
    def all_special_ids(self) -> list[int]:
        return [self.convert_tokens_to_ids(t) for t in self.all_special_tokens]

    # --- chat --------------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        conversation: list,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        return_dict: bool = False,
        tools: list[dict] | None = None,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> Any:
        """The conversation rendered by the model's template (or ``chat_template``: a template, or the
        name of one of the model's) as text or ids (no special tokens added: the template writes its
        own), as transformers' method of the same name answers."""
        from cachegw.backend.core import chat_template as templates  # jinja2: after start-up's peak

        named: dict[str, str] = self.chat_template if isinstance(self.chat_template, dict) else {}
        if chat_template is None:
            template = templates.pick(self.chat_template, tools)
        else:
            template = named.get(chat_template, chat_template)
        text = templates.render(
            template, conversation, self.special_tokens_map, add_generation_prompt, tools, **kwargs
        )
        if not tokenize:
            return text
        ids = self.encode(text, add_special_tokens=False)
        return {"input_ids": ids} if return_dict else ids


def open_tokenizer(folder: Path) -> Any:
    """The model's tokenizer: ours where the folder allows (no transformers), else transformers'
    ``AutoTokenizer``; None for a model without one (prompts then go in as token ids)."""
    lean = Tokenizer.read(folder)
    if lean is not None:
        release_free_heap()  # the JSON's parse: about 17 MiB of free pages otherwise kept
        return lean
    if not any((folder / f).exists() for f in ("tokenizer.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    log.info("%s's tokenizer needs transformers' own class: loading it through transformers", folder.name)
    return AutoTokenizer.from_pretrained(str(folder))
