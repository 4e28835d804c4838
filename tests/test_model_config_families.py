"""The engine's own reading of Llama, Qwen, Gemma 2/3 and Phi-3 configs, scaled ropes among them
(``backend/executor/model_config.py``, ``layers/rope_scaling.py``), gives what transformers' reading
gives: on released models' config.json (``tests/published_configs.py``), as published and as
transformers writes them back, the same ``ModelSpec``, rope settings, Gemma options, Phi-3 refusal and
stop tokens, and rope tables equal to transformers' initialisers bit for bit (the long LongRoPE set
too). What is not read exactly stays with transformers; an engine on a tiny Gemma 3 GGUF and a tiny
Llama 3.2-shaped model starts and answers with no transformers in its process."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from cachegw.backend.core.eos import eos_token_ids
from cachegw.backend.executor.layers.rope_scaling import scaled_frequencies
from cachegw.backend.executor.layers.rotary import inverse_frequencies
from cachegw.backend.executor.model_config import ModelConfig, read_model_config
from cachegw.backend.executor.models.gemma import GemmaOptions
from cachegw.backend.executor.models.llama import ModelSpec
from cachegw.backend.executor.models.phi3 import check_rope
from testkit.lean_process import heavy_imports
from tests.published_configs import LLAMA3_ROPE, PUBLISHED, without

_LLAMA32, _QWEN25 = PUBLISHED["Llama-3.2-1B-Instruct"], PUBLISHED["Qwen2.5-7B-Instruct (yarn)"]
_GEMMA2, _GEMMA3 = PUBLISHED["gemma-2-2b-it"], PUBLISHED["gemma-3-1b-it"]
_PHI35 = PUBLISHED["Phi-3.5-mini-instruct (longrope)"]
CASES: dict[str, dict[str, Any]] = {
    **PUBLISHED,
    # the classes' defaults for the keys a config.json may leave out
    "gemma-2-2b-it, defaults": without(
        _GEMMA2,
        "head_dim",
        "query_pre_attn_scalar",
        "attn_logit_softcapping",
        "final_logit_softcapping",
        "sliding_window",
        "num_key_value_heads",
        "rms_norm_eps",
        "hidden_activation",
        "eos_token_id",
        "bos_token_id",
    ),
    "gemma-3-1b-it, defaults": without(
        _GEMMA3,
        "rope_theta",
        "rope_local_base_freq",
        "sliding_window_pattern",
        "head_dim",
        "attn_logit_softcapping",
        "final_logit_softcapping",
        "rope_scaling",
        "eos_token_id",
    ),
    "Phi-3.5-mini-instruct, defaults": without(
        _PHI35,
        "original_max_position_embeddings",
        "rope_theta",
        "num_key_value_heads",
        "rms_norm_eps",
        "eos_token_id",
        "sliding_window",
    ),
    # the current format (rope_parameters) and the variants' optional keys
    "Llama-3.2-1B-Instruct, rope_parameters": {
        **without(_LLAMA32, "rope_scaling", "rope_theta"),
        "rope_parameters": {**LLAMA3_ROPE, "rope_theta": 500000.0},
    },
    "Qwen2.5 yarn, attention factor and betas": {
        **_QWEN25,
        "rope_scaling": {**_QWEN25["rope_scaling"], "attention_factor": 0.8, "beta_fast": 16, "beta_slow": 2},
    },
    "Qwen2.5 yarn, untruncated, no factor": {
        **_QWEN25,
        "max_position_embeddings": 131072,
        "rope_scaling": {
            "type": "yarn",
            "original_max_position_embeddings": 32768,
            "truncate": False,
            "factor": None,
        },
    },
    "Phi-3.5 longrope, partial factor and attention factor": {
        **_PHI35,
        "rope_scaling": {**_PHI35["rope_scaling"], "attention_factor": 1.2},
    },
    "dynamic NTK (refused by the engine)": {
        **PUBLISHED["vicuna-7b-v1.5-16k (linear)"],
        "rope_scaling": {"type": "dynamic", "factor": 2.0},
    },
    # Yarn-Llama-2-7b-64k's rope block (an unknown key, "finetuned", which transformers keeps)
    "Llama 2 with YaRN 16x": {
        **PUBLISHED["vicuna-7b-v1.5-16k (linear)"],
        "max_position_embeddings": 65536,
        "rope_scaling": {
            "factor": 16.0,
            "finetuned": True,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
    },
    # DeepSeek-V3's yarn block (mscale over mscale_all_dim) on a Qwen3 shape
    "Qwen3 yarn with mscales": {
        **PUBLISHED["Qwen3-8B (yarn)"],
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 40,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
            "original_max_position_embeddings": 4096,
        },
    },
    # the current format, nested by layer type, yarn on the global layers ("truncate" there is not read)
    "gemma-3-1b-it, nested rope_parameters with yarn": {
        **without(_GEMMA3, "rope_theta", "rope_local_base_freq", "rope_scaling"),
        "rope_parameters": {
            "full_attention": {**_QWEN25["rope_scaling"], "rope_theta": 1e6, "truncate": False},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    },
}


def _write(folder: Path, raw: dict[str, Any]) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


def _tables_equal(ours: ModelConfig, theirs: Any) -> None:
    """Each layer kind's rope table: ours against transformers' initialiser, bit for bit."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    nested = isinstance(ours.rope_parameters.get("full_attention"), dict)
    for kind in sorted(set(ours.layer_types or ())) if nested else [None]:
        params = ours.rope_parameters[kind] if kind else ours.rope_parameters
        extra = {"layer_type": kind} if kind else {}
        if params["rope_type"] == "dynamic":
            for config in (ours, theirs):
                with pytest.raises(ValueError, match="dynamic NTK"):
                    inverse_frequencies(config, ours.head_dim, kind)
            continue
        inv, scale = inverse_frequencies(ours, ours.head_dim, kind)
        if params["rope_type"] == "default":
            expected = inverse_frequencies(theirs, ours.head_dim, kind)
        else:
            expected = ROPE_INIT_FUNCTIONS[params["rope_type"]](theirs, torch.device("cpu"), **extra)
        assert inv.dtype == torch.float32 and torch.equal(inv, expected[0].float()), kind
        assert scale == float(expected[1])
        if params["rope_type"] == "longrope":  # the long set, past the original context
            context = params["original_max_position_embeddings"]
            long = ROPE_INIT_FUNCTIONS["longrope"](theirs, torch.device("cpu"), seq_len=context + 1)
            mine = scaled_frequencies(params, ours.head_dim, ours.max_position_embeddings, long=True)
            assert torch.equal(mine[0], long[0]) and mine[1] == long[1]
            assert not torch.equal(mine[0], inv)


def _same_reading(folder: Path) -> None:
    from transformers import AutoConfig

    ours, theirs = read_model_config(folder), AutoConfig.from_pretrained(str(folder))
    assert isinstance(ours, ModelConfig)
    assert ModelSpec.from_hf_config(ours) == ModelSpec.from_hf_config(theirs)
    assert ours.rope_parameters == theirs.rope_parameters
    assert (
        ours.model_type == theirs.model_type
        and ours.max_position_embeddings == theirs.max_position_embeddings
    )
    assert eos_token_ids(folder, ours, None) == eos_token_ids(folder, theirs, None)
    if ours.architectures[0].startswith("Gemma"):
        assert GemmaOptions.read(ours) == GemmaOptions.read(theirs)
    if ours.architectures[0] == "Phi3ForCausalLM":
        outcomes = []
        for config in (ours, theirs):
            try:
                check_rope(config)
                outcomes.append("runs")
            except ValueError as refused:
                outcomes.append(str(refused))
        assert outcomes[0] == outcomes[1]
    _tables_equal(ours, theirs)


@pytest.mark.parametrize("name", list(CASES))
def test_a_published_config_reads_as_transformers_reads_it(name: str, tmp_path: Path) -> None:
    """As published (legacy keys, defaults left out), and as transformers writes it back."""
    from transformers import AutoConfig

    hub = _write(tmp_path / "hub", CASES[name])
    _same_reading(hub)
    AutoConfig.from_pretrained(str(hub)).save_pretrained(str(tmp_path / "saved"))
    _same_reading(tmp_path / "saved")


FALLBACK: dict[str, dict[str, Any]] = {
    # transformers' Phi-3 class renames these to longrope and then lacks the original context: it fails
    "Phi-3 'su' (the legacy name, as Phi-3-vision-128k's config has it)": {
        **_PHI35,
        "rope_scaling": {**_PHI35["rope_scaling"], "type": "su"},
    },
    "Phi-3 with a linear rope (its class refuses it)": {
        **_PHI35,
        "rope_scaling": {"type": "linear", "factor": 2.0},
    },
    "Phi-3 factors of the wrong length": {
        **_PHI35,
        "rope_scaling": {**_PHI35["rope_scaling"], "short_factor": [1.0] * 8},
    },
    "llama3 without low_freq_factor": {**_LLAMA32, "rope_scaling": without(LLAMA3_ROPE, "low_freq_factor")},
    "a rope type not computed here": {
        **_LLAMA32,
        "rope_scaling": {"rope_type": "proportional", "factor": 2.0},
    },
    "bidirectional Gemma 3 (an embedding model)": {**_GEMMA3, "use_bidirectional_attention": True},
    "a model type not the architecture's": {**_LLAMA32, "model_type": "mistral"},
    "multimodal Gemma 3": {**_GEMMA3, "architectures": ["Gemma3ForConditionalGeneration"]},
    "hidden size not a multiple of the heads": {**_GEMMA2, "hidden_size": 2300},
}


@pytest.mark.parametrize("name", list(FALLBACK))
def test_what_is_not_read_exactly_stays_with_transformers(name: str, tmp_path: Path) -> None:
    assert ModelConfig.from_dict(FALLBACK[name]) is None
    folder = _write(tmp_path / "m", FALLBACK[name])
    try:
        config = read_model_config(folder)
    except Exception:  # transformers' own refusal (its validators' errors), as before
        return
    assert not isinstance(config, ModelConfig)


def _tiny_llama32(folder: Path) -> Path:
    """A Llama 3.2-shaped model (tied head, llama3 rope) small enough for a test, no tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = {**LLAMA3_ROPE, "original_max_position_embeddings": 64, "rope_theta": 500000.0}
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rope_parameters=rope,
        tie_word_embeddings=True,
        initializer_range=0.05,
        bos_token_id=1,
        eos_token_id=[2, 3],
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(folder), safe_serialization=True)
    return folder


def test_the_engine_answers_alike_with_either_reading(tmp_path: Path, monkeypatch) -> None:
    """Greedy tokens and logprobs of the tiny llama3-rope model: ours equal transformers' reading's."""
    from transformers import AutoConfig

    from cachegw.backend import LLM, SamplingParams

    folder = _tiny_llama32(tmp_path / "llama32")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    prompt = list(range(5, 45))
    outs, read = [], []

    def theirs(model_dir: Path) -> Any:
        read.append(model_dir)
        return AutoConfig.from_pretrained(str(model_dir))

    assert isinstance(read_model_config(folder), ModelConfig)
    for reading in ("ours", "transformers"):
        if reading == "transformers":
            monkeypatch.setattr("cachegw.backend.core.engine.read_model_config", theirs)
        llm = LLM(model=str(folder), dtype="float32", compile="off", kv_cache_tokens=256)
        assert len(read) == (reading == "transformers")
        out = llm.generate(prompt, params)[0].outputs[0]
        assert out.logprobs
        outs.append((list(out.token_ids), [step["logprob"] for step in out.logprobs]))
        del llm
    assert outs[0] == outs[1]


def test_an_engine_on_gemma3_and_llama32_imports_no_transformers(tmp_path: Path) -> None:
    """A tiny Gemma 3 GGUF (its folder written once by a child process, which uses transformers) and
    the tiny Llama 3.2-shaped folder: both start and answer, with no transformers in the process."""
    from transformers import AutoModelForCausalLM

    from testkit.tiny_gguf import write_tiny_gguf
    from tests.test_model_families_gguf import tiny_config

    torch.manual_seed(0)
    gemma = AutoModelForCausalLM.from_config(tiny_config("gemma3"), dtype=torch.float32).eval()
    path = write_tiny_gguf(gemma, tmp_path / "tiny-gemma3.gguf", "gemma3")
    llama = _tiny_llama32(tmp_path / "llama32")
    script = (
        "from cachegw.backend import LLM, SamplingParams\n"
        "from cachegw.backend.executor.model_config import ModelConfig\n"
        "p = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)\n"
        f"for model, prompt in (({str(path)!r}, [5, 6, 7]), ({str(llama)!r}, [5, 6, 7])):\n"
        "    llm = LLM(model=model, compile='off', kv_cache_tokens=256)\n"
        "    assert len(llm.generate([prompt], p)[0].outputs[0].token_ids) == 2\n"
        "    del llm\n"
    )
    assert heavy_imports(script, tmp_path / "cache") == []
    converted = next((tmp_path / "cache").rglob("config.json")).parent
    assert json.loads((converted / "config.json").read_text())["architectures"] == ["Gemma3ForCausalLM"]
    _same_reading(converted)  # the GGUF's folder, as transformers' converter wrote it
