"""Constrained decoding overhead: output tok/s with and without a JSON schema, and compile times.

Both modes generate exactly the same number of tokens per request (plain text with ignore_eos; the
schema is an open-ended list, so it never completes before max_tokens), so the batch has the same
shape step for step and the difference is the grammar's work: computing each row's mask, applying it,
advancing the matcher. The machine is shared and its load swings by 2-4x within a minute, so two
engines hold the same requests, one plain and one constrained, and are stepped in turn (ABBA by
step): the report gives tok/s per mode and round, the median ratio of paired steps, and the share
of the constrained time spent computing and applying masks (timed inside the same run).

    .venv/bin/python -m bench.structured_output  [--rounds 3] [--tokens-1 48] [--tokens-32 16]
    .venv/bin/python -m bench.structured_output --compile-only   # compile times only, tool grammars too
    (--name NAME: write bench/results/NAME.json instead)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

import cachegw.backend.executor.sampler as sampler_module
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
    from testkit.schemas import SCHEMAS

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


def add_requests(engine: Any, prompts: list[list[int]], tokens: int, structured: bool, tag: str) -> None:
    from cachegw.backend.core.sampling_params import SamplingParams, StructuredOutput

    spec = StructuredOutput.json_schema(OPEN_SCHEMA, True) if structured else None
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, structured=spec)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)


def paired_steps(engines: dict[str, Any], prompts: list[list[int]], tokens: int, tag: str) -> dict:
    """The same requests in two engines, stepped in turn (ABBA by step): each pair of steps has the
    same batch shape and runs within a fraction of a second of the other, under the same load."""
    for mode, engine in engines.items():
        add_requests(engine, prompts, tokens, mode == "json_schema", tag)
    times: dict[str, list[float]] = {mode: [] for mode in engines}
    produced = dict.fromkeys(engines, 0)
    texts: dict[str, str] = {}
    step = 0
    while any(e.has_unfinished_requests() for e in engines.values()):
        modes = list(engines) if step % 2 == 0 else list(reversed(engines))
        for mode in modes:
            start = time.perf_counter()
            outs = engines[mode].step()
            times[mode].append(time.perf_counter() - start)
            for out in outs:
                if out.finished:
                    produced[mode] += len(out.outputs[0].token_ids)
                    texts.setdefault(mode, out.outputs[0].text)
        step += 1
    assert produced["plain"] == produced["json_schema"] == tokens * len(prompts), produced
    assert texts["json_schema"].startswith('{"title": "'), texts["json_schema"]
    return {mode: {"seconds": sum(t), "steps": t} for mode, t in times.items()}


def compare(
    engines: dict[str, Any], prompts: list[list[int]], tokens: int, rounds: int, timer: MaskTimer
) -> dict:
    tok_s: dict[str, list[float]] = {mode: [] for mode in engines}
    step_ratios: list[float] = []
    timer.seconds, timer.calls = 0.0, 0
    for r in range(rounds):
        run = paired_steps(engines, prompts, tokens, f"b{len(prompts)}r{r}")
        for mode in engines:
            tok_s[mode].append(tokens * len(prompts) / run[mode]["seconds"])
        pairs = zip(run["plain"]["steps"], run["json_schema"]["steps"], strict=True)
        step_ratios += [p / j for p, j in pairs]  # > 1: the constrained step was faster
        say(f"batch {len(prompts)} round {r + 1}: plain {tok_s['plain'][-1]:.1f} tok/s, "
            f"json_schema {tok_s['json_schema'][-1]:.1f} tok/s")  # fmt: skip
    ratios = [j / p for p, j in zip(tok_s["plain"], tok_s["json_schema"], strict=True)]
    constrained_seconds = sum(tokens * len(prompts) / t for t in tok_s["json_schema"])
    return {
        "requests": len(prompts),
        "tokens_per_request": tokens,
        "plain_tok_s": [round(x, 2) for x in tok_s["plain"]],
        "json_schema_tok_s": [round(x, 2) for x in tok_s["json_schema"]],
        "ratios": [round(x, 3) for x in ratios],
        "median_ratio": round(statistics.median(ratios), 3),
        "median_paired_step_ratio": round(statistics.median(step_ratios), 3),
        "mask_ms_per_step": round(1000 * timer.seconds / max(1, timer.calls), 3),
        "mask_share_of_constrained_time": round(timer.seconds / constrained_seconds, 5),
    }


def tool_grammars() -> dict[str, Any]:
    """The Lark grammars of tool calling (bench/tool_calls.py's five tools) under each tool_choice, in
    each call format, and ``auto`` with a response_format (the union of calls and the schema)."""
    from dataclasses import replace

    from bench.tool_calls import TOOLS
    from cachegw.backend.core.sampling_params import StructuredOutput
    from cachegw.backend.entrypoints.tool_parser import LLAMA3, MISTRAL
    from cachegw.backend.entrypoints.tools import tool_request

    named = {"type": "function", "function": {"name": "convert_currency"}}
    out = {}
    for label, choice in (("required", "required"), ("auto", "auto"), ("named", named)):
        req = tool_request({"tools": TOOLS, "tool_choice": choice})
        assert req is not None
        out[f"tools_5_{label}"] = req.grammar()
        if label == "required":  # several calls in one answer (a template that knows tools)
            out["tools_5_required_parallel"] = replace(req, templated=True).grammar()
        for fmt in (LLAMA3, MISTRAL):
            out[f"tools_5_{label}_{fmt.name}"] = replace(req, templated=True, format=fmt).grammar()
    auto = tool_request({"tools": TOOLS, "tool_choice": "auto"})
    assert auto is not None
    answer = StructuredOutput.json_schema(OPEN_SCHEMA, True)
    out["tools_5_auto_or_schema"] = auto.grammar(answer)
    out["tools_5_auto_or_schema_llama3"] = replace(auto, templated=True, format=LLAMA3).grammar(answer)
    return out


def compile_times(llm: Any) -> dict:
    """Cold compile of each schema (a fresh cache), after the one-off tokenizer build."""
    from cachegw.backend.core.sampling_params import StructuredOutput
    from cachegw.backend.core.structured import GrammarCompiler

    engine = llm.engine
    compiler = GrammarCompiler(engine.tokenizer, engine.runner.spec.vocab_size, engine.eos_token_ids)
    start = time.perf_counter()
    compiler.tokenizer  # noqa: B018 - built on first use
    out: dict[str, Any] = {"tokenizer_build_ms": round(1000 * (time.perf_counter() - start), 1)}
    specs = {
        name: StructuredOutput.json_schema(schema, True) if schema else StructuredOutput("json_object")
        for name, schema in {"json_object": None, **schema_set()}.items()
    }
    for name, spec in {**specs, **tool_grammars()}.items():
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
    parser.add_argument("--compile-only", action="store_true", help="only the compile times (one engine)")
    parser.add_argument("--name", help="the results file's name (default structured_output[_compile])")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from cachegw.backend import LLM

    if args.compile_only:
        compiles = compile_times(
            LLM(compile="off", dtype="float32", quantization="none", kv_cache_tokens=1024, max_num_seqs=4)
        )
        save(args.name or "structured_output_compile", {"compile": compiles})
        say(json.dumps(compiles, indent=1))
        return

    timer = MaskTimer()
    sampler_module.apply_grammar_masks = timer  # type: ignore[assignment]
    llms = {
        mode: LLM(compile="off", dtype="float32", quantization="none", kv_cache_tokens=8192, max_num_seqs=32)
        for mode in ("plain", "json_schema")
    }
    engines = {mode: llm.engine for mode, llm in llms.items()}
    say("compiling the schema set")
    compiles = compile_times(llms["json_schema"])
    prompts = [llms["plain"].chat_prompt_ids([{"role": "user", "content": f"{QUESTIONS[i % 8]} ({i})"}])
               for i in range(32)]  # fmt: skip
    say("warm-up")
    paired_steps(engines, prompts[:4], 4, "warm")
    result: dict[str, Any] = {"schema": json.dumps(OPEN_SCHEMA), "compile": compiles}
    for size, tokens in ((1, args.tokens_1), (32, args.tokens_32)):
        result[f"batch_{size}"] = compare(engines, prompts[:size], tokens, args.rounds, timer)
        save(args.name or "structured_output", result)  # after each part: a run cut short keeps its part
    say(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
