"""The compiled decode step (executor/compiled_decode.py) gives the eager engine's tokens and logprobs.

A tiny random Mistral (2 layers, a 16-token sliding window, blocks of 8; the sliding-window tests'
model) stands in for a real checkpoint, so that Inductor compiles in seconds rather than the
tens of seconds SmolLM2 takes. The reference is transformers' own forward pass. Decodes of
different context lengths share steps, one of them with a context under one block (a table width
of 1, a size torch.compile would otherwise specialise on), and run past the window.
"""

from __future__ import annotations

import time

import pytest
import torch

from cachegw.backend import LLM, SamplingParams
from cachegw.backend.executor.compiled_decode import will_compile
from cachegw.backend.executor.layers.attention import AttentionMetadata
from tests.test_sliding_window import prompt_of, reference, tiny_windowed


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """(HF model, our engine once its decode step is compiled); the suite disables torch.compile
    elsewhere (tests/conftest.py), so it is enabled for this module only."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(tiny_windowed("mistral"), dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in hf.model.layers:  # peaked attention, so that the window changes the logits
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    folder = tmp_path_factory.mktemp("compiled")
    hf.save_pretrained(str(folder))
    with torch._dynamo.config.patch(disable=False):  # this thread's setting; the engine runs in it
        llm = LLM(model=str(folder), dtype="float32", device="cpu", kv_cache_tokens=1024, block_size=8,
                  max_num_batched_tokens=64, compile="background")  # fmt: skip
        graph = llm.engine.runner.compiled
        assert graph is not None
        # The default: the engine serves eagerly while a thread compiles, then switches.
        prompt = prompt_of(30, seed=3)
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
        assert out.outputs[0].token_ids == reference(hf, prompt, out.outputs[0].token_ids)[0].tolist()
        for _ in range(6000):  # the compile's own thread ends in ready or failed
            if graph.ready or graph.failed:
                break
            time.sleep(0.1)
        yield hf, llm


@pytest.mark.parametrize("lengths", [(5, 6), (30, 34, 38)])
def test_compiled_decodes_match_transformers(compiled, lengths):
    """Decodes of similar context lengths share the graph: contexts under one block (a table width of
    1) and past the window. Its attention is cachegw's paged kernel where this CPU runs cachegw's
    kernels (``[engine] cpu_kernels = "auto"``), torch's tensor ops elsewhere."""
    from cachegw.backend.executor.layers import cpu_kernels
    from cachegw.backend.executor.layers.attention import PagedAttention

    hf, llm = compiled
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, PagedAttention)]
    status = cpu_kernels.choose("auto")
    assert all(m.native_decode == (status.ops if status.available else None) for m in layers)
    graph = llm.engine.runner.compiled
    assert graph is not None and graph.ready, graph and graph.failed
    prompts = [prompt_of(n, seed=n) for n in lengths]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=0)
    before = graph.steps
    results = llm.generate(prompts, params)
    assert graph.steps - before >= 19  # every decode step ran the graph
    for prompt, result in zip(prompts, results, strict=True):
        out = result.outputs[0]
        choice, logprob = reference(hf, prompt, out.token_ids)
        assert out.token_ids == choice.tolist()
        assert (torch.tensor([d["logprob"] for d in out.logprobs]) - logprob).abs().max() < 1e-4


def test_decodes_of_far_apart_lengths(compiled):
    """With torch's attention the graph pads every decode to the longest context, so a batch of
    far-apart lengths (several of the eager path's groups) would read mostly padding and runs eagerly;
    cachegw's paged kernel reads each sequence's own length, so the graph takes it. Either way the
    tokens are transformers'."""
    hf, llm = compiled
    graph = llm.engine.runner.compiled
    prompts = [prompt_of(5, seed=1), prompt_of(50, seed=2)]  # prefilled in one step, then decoded together
    before = graph.steps
    results = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert (graph.steps > before) == bool(llm.engine.runner.native_decode)
    for prompt, result in zip(prompts, results, strict=True):
        assert result.outputs[0].token_ids == reference(hf, prompt, result.outputs[0].token_ids)[0].tolist()


def test_a_step_the_graph_does_not_cover_falls_back_to_eager(compiled):
    """Inputs of another dtype would need a new compile: the engine logs it and goes on eagerly."""
    hf, llm = compiled
    graph = llm.engine.runner.compiled
    with torch.inference_mode():
        step = AttentionMetadata.one_prefill(1, 8)
        assert graph(torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), step) is None
    assert not graph.ready and graph.failed
    prompt = prompt_of(12, seed=7)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == reference(hf, prompt, out.outputs[0].token_ids)[0].tolist()


def test_torch_compile_disabled_means_eager():
    with torch._dynamo.config.patch(disable=True):  # what TORCH_COMPILE_DISABLE=1 sets
        assert not will_compile("startup") and not will_compile("background")
    with torch._dynamo.config.patch(disable=False):
        assert will_compile("background") and not will_compile("off")


def test_a_second_engine_in_the_process_gets_its_own_graph(compiled, tmp_path):
    """torch.compile keeps graphs per code object, and the guards on the weights are skipped: without a
    code object per engine, this bfloat16 engine would run the first engine's float32 graph."""
    hf, llm = compiled
    folder = tmp_path / "model"
    hf.save_pretrained(str(folder))
    with torch._dynamo.config.patch(disable=False):
        other = LLM(model=str(folder), dtype="bfloat16", device="cpu", kv_cache_tokens=1024, block_size=8,
                    compile="startup")  # fmt: skip
        graph = other.engine.runner.compiled
        assert graph is not None and graph.ready
        prompt = prompt_of(30, seed=1)
        out = other.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    assert graph.steps >= 11
    assert out.outputs[0].token_ids == reference(hf, prompt, out.outputs[0].token_ids)[0].tolist()
