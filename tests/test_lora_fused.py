"""LoRA adapters of Phi-3, whose checkpoints fuse q/k/v (``qkv_proj``) and gate/up (``gate_up_proj``),
so its PEFT adapters target the fused projections: the engine serves them as their parts (one A
each, B's rows split), and its greedy tokens and logprobs equal PEFT's merged model's in transformers,
beside the base in one batch. An adapter whose fused B does not fit the model is refused with the
reason."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.test_lora import save_adapter
from tests.test_model_families import reference, save_random

peft = pytest.importorskip("peft", reason="peft is not installed (the dev extra)")

FUSED_TARGETS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
PROMPTS = [list(range(30, 60)), list(range(100, 117))]


@pytest.fixture(scope="module")
def phi3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("phi3-lora")
    save_random("phi3", root / "base")
    adapter = save_adapter(root / "base", root / "lora", 5, r=8, lora_alpha=16, target_modules=FUSED_TARGETS)
    return root / "base", adapter


def test_a_phi3_adapter_of_fused_projections_matches_peft_merged(phi3: tuple[Path, Path]) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from cachegw.backend import LLM, SamplingParams

    base, adapter = phi3
    llm = LLM(str(base), device="cpu", dtype="float32", quantization="none", kv_cache_tokens=1024,
              max_loras=1, max_lora_rank=8, lora_modules={"phi": str(adapter)})  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    outs = llm.generate(PROMPTS, [params, replace(params, lora=llm.lora("phi"))])
    plain = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    merged = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32), str(adapter)
    ).merge_and_unload()
    for hf, prompt, out in zip((plain, merged.eval()), PROMPTS, outs, strict=True):
        got = out.outputs[0]
        want, logprobs = reference(hf, prompt, got.token_ids)
        assert got.token_ids == want
        assert [d["logprob"] for d in got.logprobs] == pytest.approx(logprobs, abs=2e-4)
    alone = llm.generate([PROMPTS[0]], [replace(params, lora=llm.lora("phi"))])[0].outputs[0].token_ids
    assert alone != outs[0].outputs[0].token_ids, "the adapter changes the answer"


def test_a_fused_adapter_of_another_shape_is_refused(phi3: tuple[Path, Path], tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from cachegw.backend import LLM
    from cachegw.backend.executor.lora_adapter import AdapterError

    base, adapter = phi3
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_bytes((adapter / "adapter_config.json").read_bytes())
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    name = next(k for k in tensors if "qkv_proj.lora_B" in k)
    tensors[name] = tensors[name][:-16].contiguous()  # one KV head (16 rows) short
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="qkv_proj: B has .* rows"):
        LLM(str(base), device="cpu", dtype="float32", quantization="none", kv_cache_tokens=1024,
            max_loras=1, max_lora_rank=8, lora_modules={"phi": str(bad)})  # fmt: skip
