"""Constrained decoding overhead: output tok/s with and without a JSON schema, and compile times.

Both modes generate exactly the same number of tokens per request (plain text with ignore_eos; the
schema is an open-ended list, so it never completes before max_tokens), so the batch has the same
shape step for step and the difference is the grammar's work: computing each row's mask, applying it,
advancing the matcher. The machine is shared, so the modes alternate (ABBA) over several rounds and
the report is the ratio per pair of runs plus their median, and, steadier under load, the share
of each constrained run spent computing and applying masks (timed inside the same run).

    .venv/bin/python -m bench.structured_output  [--rounds 3] [--tokens-1 48] [--tokens-32 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

import backend.sampler as sampler_module
from bench.common import save, say

# An object whose list can go on for as long as max_tokens lets it: both modes run every step.
OPEN_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 24},
        "items": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 500},
    },
    "required": ["title", "items"],
    "additionalProperties": False,
}
QUESTIONS = [
    "List fruits as JSON.", "List European capitals as JSON.", "List colours as JSON.",
    "List animals as JSON.", "List programming languages as JSON.", "List rivers as JSON.",
    "List planets as JSON.", "List musical instruments as JSON.",
]  # fmt: skip


def schema_set() -> dict[str, dict]:
    from tests.test_structured_output import SCHEMAS

    return {"open_list": OPEN_SCHEMA, **{k: v for k, (_, v) in SCHEMAS.items()}}


class MaskTimer:
    """Wraps the sampler's mask step to add up the time it takes (bench-only instrumentation)."""

    def __init__(self) -> None:
        self.seconds, self.calls = 0.0, 0
        self._inner = sampler_module.apply_grammar_masks

    def __call__(self, logits: torch.Tensor, grammars: list) -> None:
        start = time.perf_counter()
        self._inner(logits, grammars)
        self.seconds += time.perf_counter() - start
        self.calls += 1


def run(llm: Any, prompts: list[list[int]], tokens: int, structured: bool, timer: MaskTimer) -> dict:
    from backend.sampling_params import SamplingParams, StructuredOutput

    spec = StructuredOutput.json_schema(OPEN_SCHEMA, True) if structured else None
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, structured=spec)
    timer.seconds, timer.calls = 0.0, 0
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == tokens * len(prompts), "a request ended early: the modes would not be comparable"
    if structured:
        text = outs[0].outputs[0].text
        assert text.startswith('{"title": "'), text
    mask_ms = 1000 * timer.seconds / max(1, timer.calls)
    share = timer.seconds / elapsed  # measured under the same load as the run itself
    return {"seconds": elapsed, "tok_s": produced / elapsed, "mask_ms_per_step": mask_ms, "mask_share": share}


def compare(llm: Any, prompts: list[list[int]], tokens: int, rounds: int, timer: MaskTimer) -> dict:
    runs: dict[str, list[dict]] = {"plain": [], "json_schema": []}
    for r in range(rounds):
        order = ("plain", "json_schema") if r % 2 == 0 else ("json_schema", "plain")  # ABBA
        for mode in order:
            runs[mode].append(run(llm, prompts, tokens, mode == "json_schema", timer))
            say(f"batch {len(prompts)} round {r + 1} {mode}: {runs[mode][-1]['tok_s']:.1f} tok/s")
    ratios = [s["tok_s"] / p["tok_s"] for p, s in zip(runs["plain"], runs["json_schema"], strict=True)]
    return {
        "requests": len(prompts),
        "tokens_per_request": tokens,
        "plain_tok_s": [round(x["tok_s"], 2) for x in runs["plain"]],
        "json_schema_tok_s": [round(x["tok_s"], 2) for x in runs["json_schema"]],
        "ratios": [round(x, 3) for x in ratios],
        "median_ratio": round(statistics.median(ratios), 3),
        "mask_ms_per_step": round(statistics.median(x["mask_ms_per_step"] for x in runs["json_schema"]), 3),
        "mask_share_of_run": round(statistics.median(x["mask_share"] for x in runs["json_schema"]), 5),
    }


def compile_times(llm: Any) -> dict:
    """Cold compile of each schema (a fresh cache), after the one-off tokenizer build."""
    from backend.sampling_params import StructuredOutput
    from backend.structured import GrammarCompiler

    engine = llm.engine
    compiler = GrammarCompiler(engine.tokenizer, engine.runner.spec.vocab_size, engine.eos_token_ids)
    start = time.perf_counter()
    compiler.tokenizer  # noqa: B018 - built on first use
    out: dict[str, Any] = {"tokenizer_build_ms": round(1000 * (time.perf_counter() - start), 1)}
    for name, schema in {"json_object": None, **schema_set()}.items():
        spec = StructuredOutput.json_schema(schema, True) if schema else StructuredOutput("json_object")
        start = time.perf_counter()
        compiler.compile(spec)
        cold = time.perf_counter() - start
        start = time.perf_counter()
        compiler.grammar(spec)
        copy = time.perf_counter() - start
        out[name] = {"compile_ms": round(1000 * cold, 2), "cached_copy_ms": round(1000 * copy, 3)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens-1", type=int, default=48, help="output tokens of the batch-1 runs")
    parser.add_argument("--tokens-32", type=int, default=16, help="output tokens of each of the 32 requests")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from backend import LLM

    timer = MaskTimer()
    sampler_module.apply_grammar_masks = timer  # type: ignore[assignment]
    llm = LLM(dtype="float32", kv_cache_tokens=32768, max_num_seqs=32)
    say("compiling the schema set")
    compiles = compile_times(llm)
    prompts = [llm.chat_prompt_ids([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + f" ({i})"}])
               for i in range(32)]  # fmt: skip
    say("warm-up")
    run(llm, prompts[:4], 4, False, timer)
    run(llm, prompts[:4], 4, True, timer)
    result: dict[str, Any] = {"schema": json.dumps(OPEN_SCHEMA), "compile": compiles}
    for size, tokens in ((1, args.tokens_1), (32, args.tokens_32)):
        result[f"batch_{size}"] = compare(llm, prompts[:size], tokens, args.rounds, timer)
        save("structured_output", result)  # after each part: a run cut short keeps what it measured
    say(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
