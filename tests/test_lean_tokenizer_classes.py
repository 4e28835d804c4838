"""The lean tokenizer on folders whose config names a model's own class (``tokenizer_classes.py``):
Qwen2/3 and Gemma 2/3 as their GGUFs' conversions write them, Llama 2-style sentencepiece folders,
and the classes AutoTokenizer picks instead of the named one (a Qwen2 model's generic name, a Phi-3 or
Mistral folder naming Llama's class, a byte-level file under Llama's name), with the settings
transformers reads beside them. Each gives transformers' ids, decoding, streamed text, token texts,
chat prompts and llguidance vocabulary (the same checks as ``test_lean_tokenizer.py``, imported);
what is not rebuilt exactly stays transformers'; and an engine on a Qwen3 GGUF imports no transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from cachegw.backend.core.tokenizer import Tokenizer, open_tokenizer
from cachegw.backend.core.tokenizer_classes import GENERIC, MODEL_TYPES, chosen_class
from testkit.lean_process import heavy_imports
from testkit.tiny_gguf import write_tokenizer_gguf
from tests.test_lean_tokenizer import (  # noqa: F401  (collected here with this module's `pair`)
    smol_folder,
    test_chat_prompts_are_transformers,
    test_ids_and_text_are_transformers,
    test_llguidance_reads_the_same_vocabulary,
    test_streamed_pieces_and_token_texts_are_transformers,
    test_the_servers_tool_prompts_are_transformers,
)

CHATML = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}" + (
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
TURNS = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m.role }}\n{{ m.content | trim }}<end_of_turn>\n"
    + ("{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
)
# (GGUF architecture, vocabulary kind, template), then what each case changes in the converted folder
GGUFS = {
    **{name: (name, "bpe", CHATML) for name in ("qwen3", "qwen2")},
    **{name: (name, "spm", TURNS) for name in ("gemma3", "gemma2", "llama", "phi3")},
}
CASES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {  # source, tokenizer_config, config.json
    "qwen3": ("qwen3", {}, {}),
    "qwen3-settings": (
        "qwen3",
        {
            "add_prefix_space": True,
            "clean_up_tokenization_spaces": True,
            "add_bos_token": True,
            "add_eos_token": True,
        },
        {},
    ),
    "qwen2-generic-name": ("qwen2", {"tokenizer_class": "PreTrainedTokenizerFast"}, {}),
    "gemma3": ("gemma3", {}, {}),
    "gemma2-settings": ("gemma2", {"add_bos_token": False, "add_eos_token": True, "unk_token": None}, {}),
    "llama2-class": ("llama", {"tokenizer_class": "LlamaTokenizer"}, {}),
    "llama2-legacy": (
        "llama",
        {"tokenizer_class": "LlamaTokenizerFast", "legacy": True, "add_prefix_space": False},
        {},
    ),
    "llama2-legacy-prefix": ("llama", {"tokenizer_class": "LlamaTokenizer", "legacy": True}, {}),
    "mistral-llama-name": ("llama", {"tokenizer_class": "LlamaTokenizer"}, {"model_type": "mistral"}),
    "phi3-llama-name": ("phi3", {"tokenizer_class": "LlamaTokenizer"}, {}),
    "byte-level-llama-name": (
        "smol",
        {
            "tokenizer_class": "LlamaTokenizerFast",
            "add_bos_token": True,
            "add_prefix_space": True,
            "clean_up_tokenization_spaces": True,
        },
        {},
    ),
    "qwen3-fast-name": ("qwen3", {"tokenizer_class": "Qwen2TokenizerFast", "add_prefix_space": False}, {}),
}


def _edit(folder: Path, name: str, changes: dict[str, Any]) -> None:
    """Set each key, or drop it where the change is None (but an unk_token of None is kept: Gemma's
    class then spells its unknown token "None")."""
    data = json.loads((folder / name).read_text())
    for key, value in changes.items():
        if value is None and key != "unk_token":
            data.pop(key, None)
        else:
            data[key] = value
    (folder / name).write_text(json.dumps(data))


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each GGUF's folder as the engine converts it (transformers' reading, in this process)."""
    from cachegw.backend.executor.gguf_meta import write_model_files

    root, out = tmp_path_factory.mktemp("gguf"), {"smol": smol_folder()}
    for name, (arch, kind, template) in GGUFS.items():
        path = write_tokenizer_gguf(root / f"{name}.gguf", arch, kind, template)
        write_model_files(path, root / name)
        out[name] = root / name
    return out


def case_folder(converted: dict[str, Path], target: Path, case: str) -> Path:
    source, tokenizer_config, config = CASES[case]
    shutil.copytree(converted[source], target, ignore=shutil.ignore_patterns("*.safetensors", "*.gguf"))
    _edit(target, "tokenizer_config.json", tokenizer_config)
    _edit(target, "config.json", config)
    return target


@pytest.fixture(scope="module", params=list(CASES))
def pair(
    request: pytest.FixtureRequest, converted: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Tokenizer, Any]:
    """(ours, transformers') on one folder; ours must be the lean tokenizer."""
    from transformers import AutoTokenizer

    folder = case_folder(converted, tmp_path_factory.mktemp("case") / request.param, request.param)
    ours = open_tokenizer(folder)
    assert isinstance(ours, Tokenizer), request.param
    return ours, AutoTokenizer.from_pretrained(str(folder))


def test_the_classes_transformers_picks_are_ours() -> None:
    """Our table of each model type's class is transformers' (registered class, distrusted names)."""
    from transformers.models.auto import tokenization_auto as auto

    for model_type, (registered, distrusted) in MODEL_TYPES.items():
        assert auto.TOKENIZER_MAPPING_NAMES.get(model_type) == registered, model_type
        assert (model_type in auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS) == distrusted, model_type


def test_the_class_read_is_the_one_transformers_picks(converted: dict[str, Path], tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    for case in CASES:
        folder = case_folder(converted, tmp_path / case, case)
        theirs = type(AutoTokenizer.from_pretrained(str(folder))).__name__
        name = json.loads((folder / "tokenizer_config.json").read_text())["tokenizer_class"]
        model = json.loads((folder / "config.json").read_text())["model_type"]
        text = (folder / "tokenizer.json").read_text()
        ours = chosen_class(name, model, lambda: '"ByteLevel"' in text)  # noqa: B023 (called at once)
        assert ours is not None
        assert ("TokenizersBackend" if ours in GENERIC else ours.removesuffix("Fast")) == theirs, case


def test_what_is_not_rebuilt_exactly_stays_with_transformers(
    converted: dict[str, Path], tmp_path: Path
) -> None:
    """A class's default special token the vocabulary lacks (transformers adds it as a new token), a
    model type we have no table for, and a tokenizer transformers splits special tokens in: all read
    by transformers."""
    from transformers import AutoTokenizer

    cases: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
        ("smol", {"tokenizer_class": "GemmaTokenizer"}, {}),  # no <mask>, <pad>: transformers appends them
        ("qwen3", {"tokenizer_class": "Qwen2Tokenizer"}, {"model_type": "gpt2"}),
        ("qwen3", {"split_special_tokens": True}, {}),
    ]
    for i, (source, tokenizer_config, config) in enumerate(cases):
        folder = tmp_path / str(i)
        shutil.copytree(converted[source], folder, ignore=shutil.ignore_patterns("*.safetensors", "*.gguf"))
        _edit(folder, "tokenizer_config.json", tokenizer_config)
        _edit(folder, "config.json", config)
        assert Tokenizer.read(folder) is None, (source, tokenizer_config, config)
    assert len(AutoTokenizer.from_pretrained(str(tmp_path / "0"))) > len(Tokenizer.read(smol_folder()) or [])


def test_an_engine_on_a_qwen3_gguf_imports_no_transformers(tmp_path: Path) -> None:
    """The engine serves a Qwen3 GGUF (its folder written once by a child process) with the lean
    tokenizer and config: no transformers in its process."""
    import torch
    from transformers import AutoModelForCausalLM

    from testkit.tiny_gguf import write_tiny_gguf
    from tests.test_model_families_gguf import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen3"), dtype=torch.float32).eval()
    path = write_tiny_gguf(model, tmp_path / "tiny-qwen3.gguf", "qwen3")
    script = (
        "from cachegw.backend import LLM, SamplingParams\n"
        f"llm = LLM(model={str(path)!r}, compile='off', kv_cache_tokens=256)\n"
        "assert type(llm.engine.tokenizer).__module__ == 'cachegw.backend.core.tokenizer'\n"
        "out = llm.generate(['Hello there'], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))\n"
        "assert len(out[0].outputs[0].token_ids) == 2, out\n"
    )
    assert heavy_imports(script, tmp_path / "cache") == []
