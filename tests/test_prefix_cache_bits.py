"""A prompt's logits do not depend on what the prefix cache held when it came.

The embedded SmolLM2 as the server runs it (Q4_1 as int4 on cachegw's kernels, the fused decode step):
each prompt is computed cold (its whole prefill), then again warm, when the prefix cache holds its
full blocks and only its tail is computed against them: a one-token tail (which runs as a decode
step), a tail of a few tokens, and a long tail after a shared first part. The greedy tokens, their
logprobs and the top logprobs must be equal to the bit, and so must seeded samples: every module
computes a row by the same arithmetic whatever else shares its step (executor/fused_decode.py
``share_arithmetic``, layers/cpu_kernels_modules.h).
"""

from __future__ import annotations

import pytest

from cachegw.backend import LLM, SamplingParams
from cachegw.backend.executor.layers import cpu_kernels
from tests.test_sliding_window import prompt_of

STATUS = cpu_kernels.choose("auto")
pytestmark = pytest.mark.skipif(not STATUS.available, reason=f"cachegw's CPU kernels: {STATUS.reason}")

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
SEEDED = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=7, n=3, logprobs=0)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", quantization="auto", kv_cache_tokens=4096, max_num_seqs=8,
               enable_prefix_caching=True, compile="off")  # fmt: skip


def _answers(
    llm: LLM, prompt: list[int], params: SamplingParams, cached: int = 0
) -> list[tuple[list[int], list[dict]]]:
    """Each sample's token ids and logprobs, the prompt found ``cached`` tokens deep in the cache."""
    out = llm.generate([prompt], params)[0]
    assert out.num_cached_tokens == cached
    return [(list(s.token_ids), s.logprobs) for s in out.outputs]


@pytest.mark.parametrize(("length", "seed"), [(33, 1), (100, 2)])
def test_a_warm_prompt_gives_the_cold_prompts_bits(llm: LLM, length: int, seed: int) -> None:
    """33 tokens: two blocks of 16 cached, the last token alone (a decode step, fused); 100: six
    blocks cached, a four-token tail (a prefill chunk against the cached blocks)."""
    assert llm.engine.runner.fused is not None
    prompt = prompt_of(length, seed=seed)
    cold = _answers(llm, prompt, GREEDY)
    warm = _answers(llm, prompt, GREEDY, cached=length - 1 - (length - 1) % 16)
    assert warm == cold  # token ids, logprobs and top logprobs, exactly


def test_a_long_tail_after_a_shared_prefix_gives_the_bits_of_its_whole_prefill(llm: LLM) -> None:
    """A prompt whose first 64 tokens another prompt left in the cache (a 150-token tail against
    them) against the same prompt computed whole once the cache is reset."""
    shared = prompt_of(64, seed=3)
    llm.generate([shared + prompt_of(20, seed=4)], GREEDY)
    prompt = shared + prompt_of(150, seed=5)
    warm = _answers(llm, prompt, GREEDY, cached=64)
    llm.engine.block_manager.reset_prefix_cache()
    cold = _answers(llm, prompt, GREEDY)
    assert warm == cold


def test_seeded_samples_are_the_same_cold_and_warm(llm: LLM) -> None:
    """Seeds reproduce draws; with the same logits in both cache states they reproduce the samples."""
    prompt = prompt_of(70, seed=6)
    cold = _answers(llm, prompt, SEEDED)
    warm = _answers(llm, prompt, SEEDED, cached=64)
    assert warm == cold
    assert len({tuple(ids) for ids, _ in cold}) > 1  # three different samples
