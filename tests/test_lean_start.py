"""A quantized engine starts lean: the GGUF's config and tokenizer are written without weights (no
float32 copy of the model on a first start), a tied Q4/Q8 embedding is read from the LM head's own
blocks (one table), the head is built in row ranges, Dynamo is loaded only to compile, and a script's
``LLM`` settles its threads like `cachegw backend` and does not compile unless asked."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from cachegw.backend.config import load_engine_config
from cachegw.backend.executor import cpu_threads
from cachegw.backend.executor.gguf_weights import decode_blocks
from cachegw.backend.executor.layers.block_embedding import BlockEmbedding
from cachegw.backend.executor.layers.quantized_linear import BlockLinear
from cachegw.backend.executor.model_loader import embedded_gguf_path, resolve_model_dir


def _raw(kind: str, rows: int = 300, cols: int = 128) -> np.ndarray:
    w = np.random.default_rng(0).normal(0, 0.05, (rows, cols)).astype(np.float32)
    return quantize(w, GGMLQuantizationType[kind])


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_head_in_row_ranges_equals_the_whole_and_the_embedding_reads_its_rows(kind: str) -> None:
    raw = _raw(kind)
    whole = BlockLinear.from_blocks(decode_blocks(kind, raw), None)
    ranges = (decode_blocks(kind, raw[i : i + 64]) for i in range(0, 300, 64))
    parts = BlockLinear.from_block_rows(ranges, 300)
    assert (parts.out_features, parts.in_features, parts.bits) == (300, 128, whole.bits)
    for name in ("w", "d", "m"):
        assert torch.equal(getattr(parts, name), getattr(whole, name))
    embedding = BlockEmbedding(parts, torch.float32)
    ids = torch.tensor([[0, 299], [7, 7]])
    expected = parts.dequantized()[ids]
    torch.testing.assert_close(embedding(ids), expected, rtol=0, atol=0)
    # the file's values exactly (scales in float16 as the kernel keeps them: Q4/Q8's own precision)
    torch.testing.assert_close(expected[0, 0], decode_blocks(kind, raw).dequantize()[0], rtol=1e-3, atol=1e-3)
    assert not list(embedding.parameters()) and not list(embedding.buffers())  # the head owns the table


def test_default_engine_keeps_one_table_for_embedding_and_head(shared_engine) -> None:
    model = shared_engine.engine.runner.model
    if not isinstance(model.lm_head, BlockLinear):
        pytest.skip("cachegw's CPU kernels are not available here: the embedding stays float")
    assert isinstance(model.embed_tokens, BlockEmbedding) and model.embed_tokens._head[0] is model.lm_head
    floats = sum(t.numel() for t in model.parameters() if t.is_floating_point())
    assert floats < 1_000_000  # norms only: no 28-million-weight float embedding


def test_quantized_engine_reads_no_converted_weights(tmp_path: Path) -> None:
    """The folder a quantized engine needs: config, generation config and tokenizer, no weights, and
    the same config a full conversion writes."""
    folder = resolve_model_dir("", tmp_path, weights=False)
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= names
    assert not any(n.endswith(".safetensors") for n in names)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 30
    assert "quantization_config" not in config
    assert resolve_model_dir("", tmp_path, weights=False) == folder  # written once
    from transformers import AutoTokenizer

    digits = AutoTokenizer.from_pretrained(str(folder))("12345")["input_ids"]
    assert len(digits) == 5  # SmolLM's digit splitting restored


def test_a_float_engine_still_converts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    called: list[Path] = []

    def convert(path: Path, cache: Path) -> Path:
        called.append(path)
        return cache

    monkeypatch.setattr("cachegw.backend.executor.model_loader.convert_gguf", convert)
    resolve_model_dir("", tmp_path, weights=True)
    assert called == [embedded_gguf_path()]


_IMPORTS = """
import sys
from cachegw.backend import LLM, SamplingParams
import cachegw.backend.core.engine
print("torch" in sys.modules, "torch._dynamo" in sys.modules)
"""


def test_llm_import_is_torch_free_and_the_engine_needs_no_dynamo() -> None:
    out = subprocess.run([sys.executable, "-c", _IMPORTS], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "False"]  # torch with the engine; Dynamo only to compile
    lone = _IMPORTS.replace("import cachegw.backend.core.engine\n", "")
    out = subprocess.run([sys.executable, "-c", lone], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_script_threads_are_settled_and_a_late_torch_is_named(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_WAIT_POLICY", "")  # restored after: settling sets it
    cfg = load_engine_config(threads=2, omp_wait_policy="passive")
    try:
        with caplog.at_level(logging.INFO, logger="cachegw.backend"):
            plan = cpu_threads.settle_for_script(cfg)
        assert plan.threads == torch.get_num_threads() == 2 and plan.wait_policy == "PASSIVE"
        assert "torch was imported before LLM()" in caplog.text  # this test process imported it first
    finally:
        torch.set_num_threads(before)


def test_a_script_engine_compiles_only_when_asked() -> None:
    from cachegw.backend import LLM

    llm = LLM(load_format="dummy", kv_cache_tokens=64, max_num_seqs=1)
    assert llm.engine.config.compile == "off" and llm.engine.runner.compiled is None
