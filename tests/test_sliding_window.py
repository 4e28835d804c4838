"""Sliding-window attention: the engine matches transformers past the window, and not full attention.

Tiny random models (2 layers, window 16, blocks of 8) written with transformers' own save_pretrained
stand in for real Mistral and Qwen2 checkpoints. Query/key weights are scaled up so attention is
peaked enough for the window to change the logits. Prompts are longer than the window and prefill
in chunks of 16 tokens, so every chunk after the first is a prefill over a cached prefix; the
decodes that follow are past the window too. The reference is one forward pass of HF's model over
prompt + output (HF's sliding-window mask), compared per generated token: the greedy choice and its
logprob.
"""

from __future__ import annotations

import pytest
import torch

from cachegw.backend import LLM, SamplingParams
from cachegw.backend.core.block_manager import FREED, BlockManager
from cachegw.backend.core.sequence import Sequence
from cachegw.backend.executor.models.llama import layer_windows
from tests.test_model_families import COMMON

WINDOW = 16


def tiny_windowed(kind: str):
    from transformers import MistralConfig, Qwen2Config

    if kind == "mistral":
        return MistralConfig(**COMMON, rope_theta=10000.0, sliding_window=WINDOW)
    # Qwen2 slides in the layers from max_window_layers on: here the second of two.
    return Qwen2Config(**COMMON, rope_theta=10000.0, use_sliding_window=True, sliding_window=WINDOW,
                       max_window_layers=1)  # fmt: skip


@pytest.fixture(scope="module", params=["mistral", "qwen2"])
def windowed(request, tmp_path_factory):
    """(HF model with the window, the same weights with full attention, our engine on them)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(tiny_windowed(request.param), dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(str(folder))
    unwindowed = tiny_windowed(request.param)
    unwindowed.sliding_window, unwindowed.layer_types = None, ["full_attention"] * COMMON["num_hidden_layers"]
    full = AutoModelForCausalLM.from_config(unwindowed, dtype=torch.float32).eval()
    full.load_state_dict(hf.state_dict())
    llm = LLM(model=str(folder), dtype="float32", device="cpu", kv_cache_tokens=1024, block_size=8,
              max_num_batched_tokens=16)  # fmt: skip
    return hf, full, llm


def prompt_of(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference(model, prompt: list[int], output: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's greedy choice and the logprob of each of ``output``'s tokens, teacher-forced."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logprobs = model(ids).logits.log_softmax(-1)[0]
    rows = torch.arange(len(prompt) - 1, ids.shape[1] - 1)
    return logprobs[rows].argmax(-1), logprobs[rows, ids[0, rows + 1]]


def generate(llm: LLM, prompt: list[int], max_tokens: int = 24):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    return llm.generate([prompt], params)[0]


def test_layer_windows_follow_transformers():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = {**COMMON, "num_hidden_layers": 4}
    assert layer_windows(MistralConfig(**common, sliding_window=32), "MistralForCausalLM") == (32,) * 4
    assert layer_windows(MistralConfig(**common, sliding_window=None), "MistralForCausalLM") == (None,) * 4
    qwen = Qwen2Config(**common, use_sliding_window=True, sliding_window=32, max_window_layers=3)
    assert layer_windows(qwen, "Qwen2ForCausalLM") == (None, None, None, 32)
    off = Qwen2Config(**common, use_sliding_window=False, sliding_window=32, max_window_layers=0)
    assert layer_windows(off, "Qwen2ForCausalLM") == (None,) * 4
    llama = LlamaConfig(**common)
    llama.sliding_window = 8  # Llama's model has no window whatever its config says
    assert layer_windows(llama, "LlamaForCausalLM") == (None,) * 4


def test_greedy_matches_transformers_past_the_window(windowed):
    hf, full, llm = windowed
    prompt = prompt_of(48, seed=1)
    out = generate(llm, prompt).outputs[0]
    choice, logprob = reference(hf, prompt, out.token_ids)
    assert out.token_ids == choice.tolist()
    ours = torch.tensor([d["logprob"] for d in out.logprobs])
    assert (ours - logprob).abs().max() < 1e-4
    # Full attention over the same weights gives other logprobs: the window really was applied.
    assert (ours - reference(full, prompt, out.token_ids)[1]).abs().max() > 1e-2


def test_prefill_over_a_cached_prefix_past_the_window(windowed):
    """The next turn finds the first turn's blocks in the prefix cache and prefills the rest over them."""
    hf, _, llm = windowed
    first = prompt_of(40, seed=2)
    turn = first + generate(llm, first, max_tokens=8).outputs[0].token_ids + prompt_of(20, seed=3)
    result = generate(llm, turn, max_tokens=12)
    assert result.num_cached_tokens >= 40
    choice, logprob = reference(hf, turn, result.outputs[0].token_ids)
    assert result.outputs[0].token_ids == choice.tolist()
    assert (torch.tensor([d["logprob"] for d in result.outputs[0].logprobs]) - logprob).abs().max() < 1e-4


def computed(bm: BlockManager, s: Sequence, upto: int) -> None:
    """Give s blocks for its first ``upto`` tokens, mark them computed, cache and free as the engine does."""
    if not s.block_table:
        bm.allocate(s, [], upto)
    else:
        bm.append_slots(s, upto - s.num_computed_tokens)
    s.num_computed_tokens = upto
    bm.cache_computed_blocks(s)
    bm.free_outside_window(s)


def test_blocks_before_every_window_go_back_to_the_pool():
    bm = BlockManager(8, 4, window=6)
    s = Sequence("a", list(range(30)), SamplingParams())
    computed(bm, s, 12)  # the query at 12 sees 7..12: block 0 (0..3) is out, block 1 (4..7) is not
    assert s.block_table[0] == FREED and FREED not in s.block_table[1:]
    assert bm.num_free_blocks == 8 - 2
    computed(bm, s, 30)  # the query at 30 sees 25..30: blocks 0..5 out, 6 and 7 (24..29) held
    assert s.block_table[:6] == [FREED] * 6 and bm.num_free_blocks == 8 - 2
    child = Sequence("a", list(range(30)), SamplingParams())
    bm.fork(s, child)  # a sample forked past the window shares only the held blocks
    assert child.block_table[:6] == [FREED] * 6
    bm.free_blocks(child)
    bm.free_blocks(s)
    assert bm.num_free_blocks == 8 and all(b.ref_count == 0 for b in bm.blocks)


def test_a_freed_block_keeps_its_prefix_findable_until_evicted():
    """Freed blocks keep their hash (their K/V are right for anyone with the same prefix); once the
    first is evicted, the lookup stops there, and no later block stands in for the prefix."""
    bm = BlockManager(8, 4, window=6)
    s = Sequence("a", list(range(30)), SamplingParams())
    computed(bm, s, 30)
    again = Sequence("b", list(range(30)), SamplingParams())
    assert len(bm.find_cached_prefix(again)) == 7  # the freed blocks 0..5 and the held 6
    other = Sequence("c", list(range(100, 104)), SamplingParams())
    bm.allocate(other, [], 4)  # takes the front of the free queue: block 0 of s, the oldest freed
    assert bm.find_cached_prefix(Sequence("d", list(range(30)), SamplingParams())) == []


def test_most_blocks_held_is_bounded_by_the_window():
    assert BlockManager(8, 4).most_blocks_held(1000, 16) == 250
    assert BlockManager(8, 4, window=6).most_blocks_held(1000, 16) == 7
    assert BlockManager(8, 4, window=6).most_blocks_held(10, 16) == 3


def test_a_sequence_longer_than_the_pool_runs_within_the_window(windowed):
    """Mistral slides in every layer: 88 tokens run in a pool of 6 blocks (48 tokens), which the
    engine refused before blocks were freed, and still match HF."""
    hf, _, llm = windowed
    if llm.engine.block_manager.window is None:
        pytest.skip("Qwen2 here has a full-attention layer: nothing can be freed")
    small = LLM(model=llm.engine.config.model, dtype="float32", device="cpu", kv_cache_tokens=48,
                block_size=8, max_num_batched_tokens=16)  # fmt: skip
    prompt = prompt_of(48, seed=4)
    out = generate(small, prompt, max_tokens=40).outputs[0]
    choice, logprob = reference(hf, prompt, out.token_ids)
    assert out.token_ids == choice.tolist()
    assert (torch.tensor([d["logprob"] for d in out.logprobs]) - logprob).abs().max() < 1e-4
    assert small.engine.block_manager.num_free_blocks == 6
