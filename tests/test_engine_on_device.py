"""The engine's features on the test's device: CUDA where there is one (the GPU check runs this file,
bench/gpu_check.sh), else the CPU (every test run, so the file itself stays right).

Plain prefill and decode are checked on CUDA elsewhere (test_triton_engine, bench/gpu_parity); the
features here run generic torch code besides (masks, generators, host copies, per-request tensors)
where a CPU tensor meeting a CUDA one is the usual bug. Each test runs a feature on a small random
Llama (testkit/random_llama.py, with a byte-level tokenizer beside it) and compares it with the same
engine, on the same device, without the feature: greedy tokens equal, or the feature's own visible
effect. On CUDA the engines run their defaults (Triton attention, CUDA-graph decode) but for
``compile="off"``; one engine runs ``enforce_eager=True`` as the graphs' reference.

    pytest -m device -s    # -s prints the KV-cache dtypes' agreement figures
"""

from __future__ import annotations

import gc
import json
import math
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from cachegw.backend import LLM, SamplingParams
from cachegw.backend.core.sampling_params import StructuredOutput
from testkit.random_llama import LlamaShape, save_byte_tokenizer, save_random_llama

pytestmark = pytest.mark.device

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPE = LlamaShape(576, 2, 9, 3, 64, 1536, 4096)  # SmolLM2's head shape, 2 layers
NEW = 16
_rng = random.Random(0)
PROMPTS = [[_rng.randrange(3, SHAPE.vocab) for _ in range(n)] for n in (60, 37, 20, 45)]
CACHED = [48, 32, 16, 32]  # their full 16-token blocks before the last prompt token
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
LP = 3  # top logprobs asked for

Engines = Callable[..., LLM]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = save_random_llama(tmp_path_factory.mktemp("device-llama"), SHAPE, seed=5)
    return save_byte_tokenizer(folder, SHAPE.vocab)


@pytest.fixture(scope="module")
def engines(model_dir: Path) -> Iterator[Engines]:
    """``engines(**engine_keys)``: an engine on DEVICE, one per distinct set of keys, shared by the
    module's tests and freed when it ends."""
    made: dict[str, LLM] = {}

    def get(**keys: Any) -> LLM:
        name = json.dumps(keys, sort_keys=True)
        if name not in made:
            settings: dict[str, Any] = dict(
                device=DEVICE, dtype="float32", quantization="none", compile="off",
                kv_cache_tokens=2048, max_num_seqs=4,
            )  # fmt: skip
            made[name] = LLM(str(model_dir), **(settings | keys))
        return made[name]

    yield get
    for llm in made.values():
        llm.engine.close()
    made.clear()
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def base(engines: Engines) -> LLM:
    return engines()


@pytest.fixture(scope="module")
def reference(base: LLM) -> list[list[int]]:
    """PROMPTS' greedy tokens, one batch on the plain engine."""
    return tokens(base.generate(PROMPTS, GREEDY, cache_salt="reference"))


def tokens(outs: list) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def logprobs(outs: list) -> list[list[float]]:
    return [[e["logprob"] for e in o.outputs[0].logprobs] for o in outs]


def max_difference(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def test_the_engines_run_on_the_device_with_its_defaults(engines: Engines, base: LLM) -> None:
    runner = base.engine.runner
    assert runner.device.type == DEVICE
    if DEVICE == "cuda":  # else every check here would pass on paths the GPU never takes
        assert runner.attention_backend == "triton" and len(runner.graphs or ()) > 0
        assert not engines(enforce_eager=True).engine.runner.graphs


def test_cuda_graph_decode_gives_eager_tokens_and_logprobs(engines: Engines, base: LLM, reference) -> None:
    params = replace(GREEDY, logprobs=LP)
    graphs = base.generate(PROMPTS, params, cache_salt="graphs")
    eager = engines(enforce_eager=True).generate(PROMPTS, params)
    assert tokens(graphs) == tokens(eager) == reference
    assert max_difference(logprobs(graphs), logprobs(eager)) < 1e-4
    for out in graphs:  # greedy: each chosen token is the top one, listed with LP of the most likely
        for entry in out.outputs[0].logprobs:
            top = entry["top"]
            assert len(top) == LP and top[0][0] == entry["token_id"] and top[0][1] == entry["logprob"]
            assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True) and top[0][1] <= 0


def test_a_repeated_prompt_is_served_from_the_prefix_cache(base: LLM, reference) -> None:
    params = replace(GREEDY, logprobs=0)
    cold = base.generate(PROMPTS, params, cache_salt="prefix")
    warm = base.generate(PROMPTS, params, cache_salt="prefix")
    assert [o.num_cached_tokens for o in cold] == [0, 0, 0, 0]
    assert [o.num_cached_tokens for o in warm] == CACHED
    assert tokens(cold) == tokens(warm) == reference
    assert max_difference(logprobs(cold), logprobs(warm)) < 1e-3  # prefill over a prefix: other kernels


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preempted_sequences_give_the_tokens_of_a_large_pool(engines: Engines, reference, mode: str) -> None:
    """8 blocks: the longest request's 5 fit, the batch's 16 do not, so decodes crossing a block
    boundary preempt; under swap the blocks go to host memory and come back."""
    small = engines(kv_cache_tokens=128, max_num_batched_tokens=64, preemption_mode="swap")
    engine = small.engine
    swap = engine.scheduler.swap
    assert swap is not None
    engine.block_manager.reset_prefix_cache()  # nothing found in the cache: every preempted token moves
    before = engine.stats()
    if mode == "recompute":
        engine.scheduler.swap = None
    try:
        outs = small.generate(PROMPTS, GREEDY)
    finally:
        engine.scheduler.swap = swap
    assert tokens(outs) == reference
    after = engine.stats()
    assert after.num_preemptions > before.num_preemptions, "the pool was meant to be too small"
    swapped = after.swap.swapped_out - before.swap.swapped_out
    if mode == "swap":
        assert swapped > 0 and after.swap.swapped_in == after.swap.swapped_out
        assert after.swap.fallbacks == 0 and after.swap.bytes_held == 0
    else:
        assert swapped == 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def punctuation_bias(llm: LLM) -> dict[int, float]:
    """Greedy picks among four punctuation tokens only: they never merge, so the text re-encodes to
    the same ids (a draft is accepted whole), and the output repeats n-grams (prompt lookup drafts)."""
    return {llm.tokenizer.encode(c, add_special_tokens=False)[0]: 50.0 for c in "!#$%"}


def test_speculative_decoding_gives_the_plain_engines_greedy_tokens(engines: Engines, base: LLM) -> None:
    biased = replace(GREEDY, logit_bias=punctuation_bias(base))
    penalized = replace(biased, frequency_penalty=0.5)
    plain = base.generate(PROMPTS[:3], [biased, penalized, GREEDY], cache_salt="spec")
    assert tokens(plain)[1] != tokens(base.generate(PROMPTS[1], biased))[0]  # the penalty took effect
    batch = [
        biased,  # prompt lookup over its own repeats
        replace(penalized, draft=plain[1].outputs[0].text),  # the very answer, as the request's draft
        GREEDY,  # nothing repeats: few or no drafts, none kept
    ]
    spec = engines(speculative="ngram")
    spec.engine.scheduler.speculative_max_seqs = len(batch)  # the whole batch speculates
    before = spec.engine.stats()
    outs = spec.generate(PROMPTS[:3], batch)
    after = spec.engine.stats()
    assert tokens(outs) == tokens(plain)
    accepted = after.spec_decode_accepted_tokens - before.spec_decode_accepted_tokens
    drafted = after.spec_decode_draft_tokens - before.spec_decode_draft_tokens
    # the drafted request keeps most of its draft; more than it could draft (NEW - 1): lookup drafted too
    assert accepted >= NEW - 4 and drafted > NEW - 1, (accepted, drafted)


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "size": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "size", "ok"],
    "additionalProperties": False,
}
PATTERN = r"[a-c]{4}-[0-9]{3}"


def test_structured_output_matches_its_schema_and_leaves_other_rows_alone(base: LLM, reference) -> None:
    grammars = [StructuredOutput.json_schema(SCHEMA, True), StructuredOutput.lark(f"start: /{PATTERN}/")]
    params = [replace(GREEDY, max_tokens=48, ignore_eos=False, structured=g) for g in grammars] + [GREEDY]
    outs = base.generate(PROMPTS[:3], params)
    answer = json.loads(outs[0].outputs[0].text)
    assert set(answer) == {"name", "size", "ok"} and len(answer["name"]) <= 6
    assert isinstance(answer["size"], int) and 0 <= answer["size"] <= 999 and isinstance(answer["ok"], bool)
    assert re.fullmatch(PATTERN, outs[1].outputs[0].text), outs[1].outputs[0].text
    assert [o.outputs[0].finish_reason for o in outs[:2]] == ["stop", "stop"]
    assert outs[2].outputs[0].token_ids == reference[2]  # a row without a grammar is not masked


def test_a_seed_repeats_its_sample_and_another_seed_differs(base: LLM, reference) -> None:
    def sampled(seed: int, **kw: Any) -> SamplingParams:
        return replace(GREEDY, temperature=1.0, seed=seed, **kw)

    batch = [sampled(7), sampled(7), sampled(8), sampled(7, top_p=0.9, top_k=20, logprobs=20)]
    results = base.generate([PROMPTS[0]] * 4, batch)
    outs = tokens(results)
    alone = tokens(base.generate(PROMPTS[0], sampled(7)))[0]
    assert outs[0] == outs[1] == alone  # its own generator: the batch around it changes nothing
    assert outs[2] != outs[0] and outs[0] != reference[0]  # another seed, and not greedy
    steps = results[3].outputs[0].logprobs or []
    assert len(steps) == NEW and all(e["token_id"] in {t for t, _ in e["top"]} for e in steps)  # top-k
    forked = base.generate([PROMPTS[1]] * 2, replace(sampled(9), n=2))  # two samples of one prompt each
    twins = [[c.token_ids for c in o.outputs] for o in forked]
    assert twins[0] == twins[1] and twins[0][0] != twins[0][1]


def save_adapter(folder: Path, seed: int, b_scale: float, rank: int = 8) -> str:
    """A PEFT LoRA folder (what ``save_pretrained`` writes) for q, v and down projections; B zero when
    ``b_scale`` is 0 (PEFT's own initialization: the base model exactly)."""
    from safetensors.torch import save_file

    shapes = {"self_attn.q_proj": (576, 576), "self_attn.v_proj": (576, 192), "mlp.down_proj": (1536, 576)}
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(SHAPE.layers):
        for module, (fan_in, fan_out) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            weights[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.1
            weights[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * b_scale
    folder.mkdir(parents=True)
    save_file(weights, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
              "target_modules": ["q_proj", "v_proj", "down_proj"]}  # fmt: skip
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return str(folder)


def test_a_zero_lora_gives_the_bases_tokens_and_a_trained_one_differs(
    engines: Engines, reference, tmp_path_factory: pytest.TempPathFactory
) -> None:
    root = tmp_path_factory.mktemp("device-lora")
    adapters = {"zero": save_adapter(root / "zero", 1, 0.0), "delta": save_adapter(root / "delta", 2, 0.1)}
    llm = engines(max_loras=2, max_lora_rank=8, lora_modules=adapters)
    batch = [GREEDY, replace(GREEDY, lora=llm.lora("zero")), replace(GREEDY, lora=llm.lora("delta"))]
    outs = tokens(llm.generate([PROMPTS[0]] * 3, batch))
    assert outs[0] == outs[1] == reference[0]
    assert outs[2] != reference[0]


def test_a_prefix_evicted_from_the_pool_comes_back_from_the_ram_tier(engines: Engines, reference) -> None:
    """8 blocks: the other two prompts and their tokens take all of them, evicting the first's."""
    tiered = engines(kv_cache_tokens=128, kv_offload_bytes=8 << 20)
    first = tiered.generate(PROMPTS[0], GREEDY)[0]
    others = tiered.generate([PROMPTS[1], PROMPTS[3]], GREEDY)
    again = tiered.generate(PROMPTS[0], GREEDY)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == CACHED[0]
    assert tiered.engine.stats().prefix_cache_hits_by_tier.get("ram", 0) > 0
    assert [first.outputs[0].token_ids, again.outputs[0].token_ids] == [reference[0]] * 2
    assert tokens(others) == [reference[1], reference[3]]


def test_h2o_drops_a_long_sequences_kv_and_leaves_a_short_one_exact(engines: Engines, reference) -> None:
    """A 48-token budget: the 76-token sequence drops K/V as it goes (its first token comes from the
    full prefill, so it is the reference's), the 36-token one never reaches it and decodes exactly."""
    llm = engines(kv_eviction="h2o", kv_budget_tokens=48, max_num_batched_tokens=64)
    h2o = llm.engine.h2o
    assert h2o is not None
    outs = tokens(llm.generate([PROMPTS[0], PROMPTS[2]], GREEDY))
    assert h2o.evictions > 0 and h2o.dropped_tokens >= len(PROMPTS[0]) + NEW - 48 - 16
    assert outs[0][0] == reference[0][0] and len(outs[0]) == NEW
    assert outs[1] == reference[2]
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize(("kv_dtype", "bound"), [("int8", 0.5), ("fp8", 1.5)])
def test_a_quantized_kv_cache_runs_and_stays_near_the_float_cache(
    engines: Engines, base: LLM, kv_dtype: str, bound: float
) -> None:
    """The random model's next-token distributions are nearly flat, so a small change flips a greedy
    pick and all after it: reported per prompt, asserted loosely (the log-probabilities of the steps
    before the first differing token, and no NaN)."""
    params = replace(GREEDY, logprobs=0)
    want = base.generate(PROMPTS, params, cache_salt="kv-dtype")
    got = engines(kv_cache_dtype=kv_dtype).generate(PROMPTS, params)
    firsts, shares, worst = [], [], 0.0
    for a, b, la, lb in zip(tokens(want), tokens(got), logprobs(want), logprobs(got), strict=True):
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        firsts.append(first)
        shares.append(sum(x == y for x, y in zip(a, b, strict=True)) / len(a))
        assert not any(math.isnan(x) for x in lb)
        worst = max([worst, *(abs(x - y) for x, y in zip(la[: first + 1], lb[: first + 1], strict=True))])
    print(f"\n{kv_dtype} KV cache on {DEVICE}: first differing token per prompt {firsts}, "
          f"share of equal positions {sum(shares) / len(shares):.2f}, largest logprob difference before "
          f"they part {worst:.3g}")  # fmt: skip
    assert worst < bound and max(firsts) > 0  # a broken cache would part every prompt at once


def test_stop_token_ids_and_stop_strings_end_the_reference_where_they_occur(base: LLM, reference) -> None:
    text = base.generate(PROMPTS[0], GREEDY, cache_salt="stops")[0].outputs[0].text
    stop_at = next(i for i, t in enumerate(reference[0]) if i >= 4 and t not in reference[0][:i])
    stop = next(m.group() for m in re.finditer(r"[A-Za-z0-9]{2}", text) if m.start() >= 4)
    outs = base.generate(
        [PROMPTS[0]] * 2,
        [replace(GREEDY, stop_token_ids=[reference[0][stop_at]]), replace(GREEDY, stop=[stop])],
    )
    by_id, by_text = outs[0].outputs[0], outs[1].outputs[0]
    assert by_id.token_ids == reference[0][: stop_at + 1]
    assert (by_id.finish_reason, by_id.stop_reason) == ("stop", reference[0][stop_at])
    assert by_text.text == text[: text.index(stop)]
    assert (by_text.finish_reason, by_text.stop_reason) == ("stop", stop)
    assert by_text.token_ids == reference[0][: len(by_text.token_ids)]


def test_prompt_logprobs_score_a_continuation_as_decoding_did(base: LLM, reference) -> None:
    """The prompt + its greedy continuation, scored in one prefill (``prompt_logprobs``): each
    continuation token gets the logprob decoding gave it, step by step."""
    decoded = base.generate(PROMPTS[2], replace(GREEDY, logprobs=0), cache_salt="scoring")[0]
    full = PROMPTS[2] + reference[2]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=2)
    scored = base.generate(full, params, cache_salt="scored")[0].prompt_logprobs
    assert scored is not None and scored[0] is None and len(scored) == len(full)
    tail = scored[len(PROMPTS[2]) :]
    assert [e["token_id"] for e in tail] == reference[2] == decoded.outputs[0].token_ids
    assert all(len(e["top"]) == 2 and e["top"][0][0] == e["token_id"] for e in tail)  # greedy: the top one
    assert max_difference([[e["logprob"] for e in tail]], logprobs([decoded])) < 1e-3  # prefill vs decode
