"""The serving process's own tokenizer and model config (no transformers: ``backend/core/tokenizer.py``,
``chat_template.py``, ``backend/executor/model_config.py``) give what transformers gives: the same ids
for a varied corpus, the same text decoded whole and streamed, the same token texts, the same chat
prompts (the model's template and tool-calling ones, every kind of turn, with and without the
generation prompt), the same llguidance vocabulary, the same model shape, rope and stop tokens; and
what it cannot read as transformers does is left to transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jinja2
import pytest

from cachegw.backend.core.detokenizer import IncrementalDetokenizer
from cachegw.backend.core.eos import eos_token_ids
from cachegw.backend.core.tokenizer import Tokenizer, open_tokenizer
from cachegw.backend.entrypoints.openai_mapping import TokenTexts
from cachegw.backend.entrypoints.tool_prompt import chat_prompt_ids, request_tools
from cachegw.backend.executor.layers.rotary import inverse_frequencies
from cachegw.backend.executor.model_config import ModelConfig, read_model_config
from cachegw.backend.executor.models.llama import ModelSpec
from cachegw.protocol.requests import ChatCompletionRequest
from testkit.lean_process import heavy_imports
from tests.tool_templates import HERMES_STYLE, LLAMA3_STYLE, MISTRAL_STYLE

CORPUS = [
    "",
    "Hello, world!",
    "  leading spaces and   runs of    spaces  ",
    "tabs\tand\nnewlines\n\n\nand \r\n CRLF",
    "ünïcödé: naïve café, e\u0301 (combining), ß, İstanbul",
    "中文字符与日本語のテキスト, 한국어",
    "Emoji 🎉👩‍👩‍👧‍👦 and flags 🇫🇷 and skin tones 👍🏽",
    "مرحبا بالعالم and עברית",
    "digits 12345 3.14159 1,000,000 0x1F",
    "def f(x: int) -> int:\n    return x ** 2  # square\n\nprint(f(3))",
    '{"key": [1, 2, {"nested": null}], "s": "a\\"b"}',
    "special tokens in text: <|im_start|>user\nhi<|im_end|><|endoftext|>",
    "<|im_start|><|im_start|> glued<|im_end|>text",
    "a" * 200,
    " ".join(["token"] * 50),
    "\u200b zero width \u00a0 nbsp \ufeff bom",
    "control \x01\x02 chars \x7f",
]
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather.", "parameters": CITY},
}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
}
CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief. Ünïcode 🎉"}, {"role": "user", "content": "Hi\n\n  there"}],
    [
        {"role": "system", "content": "You call tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
        {"role": "assistant", "content": "It is 21 degrees."},
        {"role": "user", "content": "Thanks <|im_end|>"},
    ],
]
# A template using what transformers' environment offers beyond plain jinja (written for this test).
FEATURES = """{%- set ns = namespace(n=0) -%}
{%- for m in messages %}
    {%- if m.role == 'forbidden' %}{{ raise_exception('role not allowed') }}{% endif %}
    {%- if loop.index > 4 %}{% break %}{% endif %}
    {%- if m.role == 'tool' %}{% continue %}{% endif %}
    {%- set ns.n = ns.n + 1 %}
    <{{ m.role }}>{{ m.content | default('', true) }}
    {%- generation %}{{ m.tool_calls | tojson(indent=2) if m.tool_calls else '' }}{% endgeneration %}
{% endfor -%}
{{ dict(a=1, b='é') | tojson }} {{ tools | tojson(sort_keys=true) }} {{ ns.n }} {{ strftime_now('%Y') }}
{%- if add_generation_prompt %}<assistant>{% endif %}"""


def smol_folder() -> Path:
    from cachegw.backend.config import load_engine_config
    from cachegw.backend.executor.model_loader import resolve_model_dir

    cfg = load_engine_config(None)
    return resolve_model_dir(cfg.model, cfg.resolved_cache_dir, weights=False)


def with_added_tokens(folder: Path, target: Path) -> Path:
    """The embedded tokenizer with tokens only tokenizer_config.json lists (as many Hub folders have
    them), an extra special token and a tool-calling template."""
    shutil.copytree(folder, target, ignore=shutil.ignore_patterns("*.safetensors", "*.gguf"))
    config = json.loads((target / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"] = {
        "49152": {"content": "<tool_call>", "special": True, "lstrip": False, "rstrip": False,
                  "normalized": False, "single_word": False},
        "49153": {"content": "</tool_call>", "special": True},
        "49154": {"content": "<plain>", "special": False, "normalized": False},
    }  # fmt: skip
    config["extra_special_tokens"] = ["<tool_call>", "</tool_call>"]
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    (target / "chat_template.jinja").write_text(HERMES_STYLE)
    return target


@pytest.fixture(scope="module", params=["embedded", "added-tokens"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, Any]:
    """(ours, transformers') on one folder."""
    from transformers import AutoTokenizer

    folder = smol_folder()
    if request.param == "added-tokens":
        folder = with_added_tokens(folder, tmp_path_factory.mktemp("tok") / "added")
    ours = open_tokenizer(folder)
    assert isinstance(ours, Tokenizer)
    return ours, AutoTokenizer.from_pretrained(str(folder))


def corpus(pair: tuple[Tokenizer, Any]) -> list[str]:
    """The corpus, and the tokenizer's own added and special tokens in text, spaced and glued."""
    added = [t.content for t in pair[0].backend_tokenizer.get_added_tokens_decoder().values()]
    return CORPUS + [f"{' '.join(added)} and {''.join(added)}x {added[-1]} "] if added else CORPUS


def test_ids_and_text_are_transformers(pair: tuple[Tokenizer, Any]) -> None:
    ours, hf = pair
    assert len(ours) == len(hf)
    assert ours.special_tokens_map == hf.special_tokens_map
    assert ours.all_special_tokens == hf.all_special_tokens and ours.all_special_ids == hf.all_special_ids
    for name in ("eos_token_id", "bos_token_id", "unk_token_id"):
        assert getattr(ours, name) == getattr(hf, name)
    for text in corpus(pair):
        for special in (False, True):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == hf.encode(text, add_special_tokens=special), text
        ids = ours.encode(text, add_special_tokens=False)
        assert ours(text)["input_ids"] == hf(text)["input_ids"]
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
        assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
        assert [ours.convert_ids_to_tokens(i) for i in ids] == [hf.convert_ids_to_tokens(i) for i in ids]
        tokens = hf.convert_ids_to_tokens(ids) + ["<never-a-token>"]
        assert ours.convert_tokens_to_ids(tokens) == hf.convert_tokens_to_ids(tokens)


def test_streamed_pieces_and_token_texts_are_transformers(pair: tuple[Tokenizer, Any]) -> None:
    ours, hf = pair
    texts_ours, texts_hf = TokenTexts(ours), TokenTexts(hf)
    for text in corpus(pair):
        ids = hf.encode(text, add_special_tokens=False) + [hf.eos_token_id]
        for skip in (True, False):
            a, b = IncrementalDetokenizer(ours, ["!"], skip), IncrementalDetokenizer(hf, ["!"], skip)
            for token in ids:
                assert a.add(token) == b.add(token)
                assert a.text == b.text and a.visible_text(False) == b.visible_text(False), text
            a.flush()
            b.flush()
            assert a.text == b.text
        assert [texts_ours.get(i) for i in ids] == [texts_hf.get(i) for i in ids]


@pytest.mark.parametrize("template", ["own", HERMES_STYLE, LLAMA3_STYLE, MISTRAL_STYLE, FEATURES])
def test_chat_prompts_are_transformers(pair: tuple[Tokenizer, Any], template: str) -> None:
    ours, hf = pair
    chosen = None if template == "own" else template
    for conversation in CONVERSATIONS:
        for tools in (None, [TOOL]):
            for generation in (True, False):
                kw: dict[str, Any] = dict(add_generation_prompt=generation, chat_template=chosen, tools=tools)
                try:
                    want = hf.apply_chat_template(conversation, tokenize=False, **kw)
                except jinja2.TemplateError as exc:  # a template refusing the turns refuses them in both
                    with pytest.raises(jinja2.TemplateError, match=str(exc)[:40]):
                        ours.apply_chat_template(conversation, tokenize=False, **kw)
                    continue
                assert ours.apply_chat_template(conversation, tokenize=False, **kw) == want
                ids = ours.apply_chat_template(conversation, tokenize=True, return_dict=False, **kw)
                want_ids = hf.apply_chat_template(conversation, tokenize=True, return_dict=False, **kw)
                assert ids == list(want_ids)


def test_the_servers_tool_prompts_are_transformers(pair: tuple[Tokenizer, Any]) -> None:
    """The server's own path (request -> tool format -> template -> ids) on either tokenizer."""
    ours, hf = pair
    for conversation in CONVERSATIONS:
        for tools in ({}, {"tools": [TOOL]}):
            req = ChatCompletionRequest.model_validate({"model": "m", "messages": conversation, **tools})
            want = chat_prompt_ids(hf, req.messages, request_tools(req, hf))
            assert chat_prompt_ids(ours, req.messages, request_tools(req, ours)) == want
            assert request_tools(req, ours) == request_tools(req, hf)


def test_a_refusing_template_raises_what_transformers_raises(pair: tuple[Tokenizer, Any]) -> None:
    ours, hf = pair
    bad = [{"role": "forbidden", "content": "x"}]
    for tok in (ours, hf):
        with pytest.raises(jinja2.TemplateError, match="role not allowed"):
            tok.apply_chat_template(bad, chat_template=FEATURES, tokenize=False)
        with pytest.raises(ValueError, match="empty conversation"):
            tok.apply_chat_template([], tokenize=False)


def test_llguidance_reads_the_same_vocabulary(pair: tuple[Tokenizer, Any]) -> None:
    import llguidance.hf

    from cachegw.backend.core.structured import GrammarCompiler

    ours, hf = pair
    eos = {hf.eos_token_id}
    mine = GrammarCompiler(ours, len(ours), eos).tokenizer
    theirs = llguidance.hf.from_tokenizer(hf, n_vocab=len(hf), eos_token=sorted(eos))
    assert (mine.vocab_size, mine.eos_token) == (theirs.vocab_size, theirs.eos_token)
    every = list(range(len(ours)))
    assert [mine.decode_bytes([i]) for i in every] == [theirs.decode_bytes([i]) for i in every]
    for text in corpus(pair):
        assert mine.tokenize_str(text) == theirs.tokenize_str(text)


def test_hub_style_config_fields_read_as_transformers(tmp_path: Path) -> None:
    """tokenizer_config.json as older and Hub folders write it: a special token as an AddedToken's
    dict, ``additional_special_tokens``, named templates (``tool_use`` taken when tools are given)."""
    from transformers import AutoTokenizer

    folder = with_added_tokens(smol_folder(), tmp_path / "hub")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["additional_special_tokens"] = config.pop("extra_special_tokens")
    config["bos_token"] = {"__type": "AddedToken", "content": "<|im_start|>", "special": True}
    config["chat_template"] = [
        {"name": "default", "template": "{{ messages[0]['content'] }}!"},
        {"name": "tool_use", "template": "{{ tools | length if tools else 0 }}: {{ messages[0].content }}"},
    ]
    (folder / "chat_template.jinja").unlink()
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    ours, hf = open_tokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
    assert isinstance(ours, Tokenizer)
    assert (
        ours.all_special_tokens == hf.all_special_tokens and ours.special_tokens_map == hf.special_tokens_map
    )
    for tools in (None, [TOOL]):
        for name in (None, "default", "tool_use"):
            kw: dict[str, Any] = dict(tools=tools, chat_template=name, tokenize=False)
            assert ours.apply_chat_template(CONVERSATIONS[0], **kw) == hf.apply_chat_template(
                CONVERSATIONS[0], **kw
            )
    for text in CORPUS:
        assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)


def test_other_tokenizer_classes_stay_with_transformers(tmp_path: Path) -> None:
    """A class not rebuilt here, settings that change the output or a tokenizer from remote code are
    transformers' to read; a folder without a tokenizer has none."""
    folder = smol_folder()
    changes: list[dict[str, Any]] = [
        {"tokenizer_class": "T5Tokenizer"},
        {"split_special_tokens": True},
        {"tokenizer_class": None},
        {"auto_map": {"AutoTokenizer": [None, "tok.OwnTokenizer"]}},
    ]
    for change in changes:
        target = tmp_path / str(len(list(tmp_path.iterdir())))
        shutil.copytree(folder, target, ignore=shutil.ignore_patterns("*.safetensors", "*.gguf"))
        config = {**json.loads((target / "tokenizer_config.json").read_text()), **change}
        kept = {k: v for k, v in config.items() if v is not None}
        (target / "tokenizer_config.json").write_text(json.dumps(kept))
        assert Tokenizer.read(target) is None
    assert open_tokenizer(tmp_path / "empty") is None


# --- the model config ------------------------------------------------------------------------------


def _configs() -> dict[str, Any]:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    shape: dict[str, Any] = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip
    return {
        "llama": LlamaConfig(
            **shape,
            rope_parameters={"rope_type": "default", "rope_theta": 5e4},
            tie_word_embeddings=True,
            eos_token_id=[2, 7],
        ),
        "llama-bias": LlamaConfig(**shape, attention_bias=True, mlp_bias=True, head_dim=32, rms_norm_eps=0.1),
        "mistral": MistralConfig(**shape, sliding_window=128),
        "mistral-no-window": MistralConfig(**shape, sliding_window=None),
        "qwen2": Qwen2Config(**shape, tie_word_embeddings=True),
        "qwen2-sliding": Qwen2Config(**shape, use_sliding_window=True, sliding_window=8, max_window_layers=2),
        "qwen3": Qwen3Config(**shape, head_dim=32),
    }


def _same_reading(folder: Path) -> None:
    from transformers import AutoConfig

    ours, theirs = read_model_config(folder), AutoConfig.from_pretrained(str(folder))
    assert isinstance(ours, ModelConfig)
    assert ModelSpec.from_hf_config(ours) == ModelSpec.from_hf_config(theirs)
    head_dim = ModelSpec.from_hf_config(ours).head_dim
    a, b = inverse_frequencies(ours, head_dim), inverse_frequencies(theirs, head_dim)
    assert a[1] == b[1] and a[0].tolist() == b[0].tolist()
    assert eos_token_ids(folder, ours, None) == eos_token_ids(folder, theirs, None)


def test_model_config_reads_as_transformers(tmp_path: Path) -> None:
    _same_reading(smol_folder())
    for name, config in _configs().items():
        config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
        config.save_pretrained(str(tmp_path / name))  # config.json and generation_config.json
        _same_reading(tmp_path / name)
        # a hand-written config.json of the same model (no generation config, legacy rope keys)
        raw = json.loads((tmp_path / name / "config.json").read_text())
        raw["rope_theta"] = raw.pop("rope_parameters")["rope_theta"]
        for key in ("layer_types", "transformers_version", "dtype"):
            raw.pop(key, None)
        (tmp_path / f"{name}-hub").mkdir()
        (tmp_path / f"{name}-hub" / "config.json").write_text(json.dumps(raw))
        _same_reading(tmp_path / f"{name}-hub")


def test_other_configs_stay_with_transformers(tmp_path: Path) -> None:
    """DeepSeek's mixture of experts (Gemma, Phi-3 and scaled ropes: tests/test_model_config_families.py)."""
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(num_hidden_layers=2)
    config.architectures = ["DeepseekV3ForCausalLM"]
    config.save_pretrained(str(tmp_path / "ds"))
    assert not isinstance(read_model_config(tmp_path / "ds"), ModelConfig)


def test_the_serving_process_imports_no_transformers() -> None:
    """The engine on the embedded model, its chat template and the HTTP server's modules: without
    transformers, and without Dynamo (which building the model on the meta device once imported)."""
    script = (
        "from cachegw.backend import LLM, SamplingParams\n"
        "import cachegw.backend.entrypoints.server\n"
        "llm = LLM(compile='off')\n"
        "out = llm.chat([{'role': 'user', 'content': 'Hi'}], SamplingParams(temperature=0, max_tokens=2))\n"
        "assert out[0].outputs[0].token_ids, out\n"
    )
    assert heavy_imports(script) == []


def test_the_servers_fork_shares_the_rust_tokenizer_across_threads(pair: tuple[Tokenizer, Any]) -> None:
    """The server's tokenizer thread encodes while the engine thread decodes, on one Rust tokenizer
    (nothing changes it after loading, so no borrow is ever refused)."""
    from concurrent.futures import ThreadPoolExecutor

    ours, hf = pair
    fork = ours.fork()
    assert fork.backend_tokenizer is ours.backend_tokenizer
    fork.chat_template = "{{ messages[0]['content'] }}"  # the server's own attribute: the engine's stays
    assert ours.chat_template != fork.chat_template
    texts = corpus(pair) * 20
    ids = [hf.encode(t, add_special_tokens=False) for t in texts]
    jobs: list[tuple[Any, Any]] = []
    for text, text_ids in zip(texts, ids, strict=True):
        jobs += [(fork.encode, text), (ours.decode, text_ids)]
    with ThreadPoolExecutor(4) as pool:  # encodes and decodes interleaved, on 4 threads
        results = list(pool.map(lambda job: job[0](job[1]), jobs))
    assert results[0::2] == ids
    assert results[1::2] == [hf.decode(i) for i in ids]
