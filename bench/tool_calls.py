"""Tool calling on the embedded SmolLM2-135M (the generic tool prompt): how often the calls are valid,
and how often ``auto`` calls when it should and answers in text when it should not.

21 questions, each offered the same five tools (weather, calculator, web search, currency conversion,
alarm: strings, enums, integers with bounds, numbers, booleans); 15 ask for one of the tools, 6 for
none. Every question runs greedy, in one batch per mode, through the server's own pieces (prompt
rendering, grammar, parsing), without HTTP:

- ``required``: one call; share that parses and validates against the function's schema (100% by
  construction) and share naming the right function;
- ``required_several``: the first questions again with several calls allowed in one answer, to show
  why the generic prompt allows one (share cut by max_tokens, calls per answer);
- ``named`` (not run by default): the expected function forced; share valid;
- ``auto``: share of the 15 that call (the right function), share of the 6 that answer in text (the
  first 16 tokens show which; the calls themselves are what ``required`` checks).

    .venv/bin/python -m bench.tool_calls  [--max-tokens 80] [--auto-tokens 16] [--several-questions 6]
                                          [--modes required,auto,required_several,named]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from typing import Any

import jsonschema

from bench.common import save, say


def _fn(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    params = {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": params}}


# Strings are bounded, as a schema for a small model should be: else it can stay inside one until max_tokens.
TEXT = {"type": "string", "maxLength": 40}
TOOLS = [
    _fn("get_weather", "The current weather in a city.",
        {"city": TEXT, "unit": {"enum": ["celsius", "fahrenheit"]}}, ["city"]),
    _fn("calculate", "Evaluate an arithmetic expression.", {"expression": TEXT}, ["expression"]),
    _fn("search_web", "Search the web and return the top results.",
        {"query": TEXT, "max_results": {"type": "integer", "minimum": 1, "maximum": 10}},
        ["query"]),
    _fn("convert_currency", "Convert an amount of money from one currency to another.",
        {"amount": {"type": "number", "minimum": 0}, "source": {"enum": ["USD", "EUR", "GBP", "JPY"]},
         "target": {"enum": ["USD", "EUR", "GBP", "JPY"]}}, ["amount", "source", "target"]),
    _fn("set_alarm", "Set an alarm clock.",
        {"hour": {"type": "integer", "minimum": 0, "maximum": 23},
         "minute": {"type": "integer", "minimum": 0, "maximum": 59}, "repeat_daily": {"type": "boolean"}},
        ["hour", "minute"]),
]  # fmt: skip
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

# (question, the function it needs or None)
QUESTIONS: list[tuple[str, str | None]] = [
    ("What is the weather in Paris right now?", "get_weather"),
    ("Is it raining in Tokyo today? Give me the temperature in fahrenheit.", "get_weather"),
    ("How cold is it in Oslo?", "get_weather"),
    ("What is 1234 multiplied by 5678?", "calculate"),
    ("Compute (17 + 25) / 3.", "calculate"),
    ("What is the square root of 144 plus 12?", "calculate"),
    ("Search the web for the latest news about the James Webb telescope.", "search_web"),
    ("Find me three articles about sourdough bread recipes.", "search_web"),
    ("Look up who won the 2022 football world cup.", "search_web"),
    ("Convert 100 US dollars to euros.", "convert_currency"),
    ("How many Japanese yen is 50 British pounds?", "convert_currency"),
    ("I have 20 EUR, what is that in USD?", "convert_currency"),
    ("Wake me up at 7:30 tomorrow.", "set_alarm"),
    ("Set an alarm for 6 am every day.", "set_alarm"),
    ("Please set an alarm at 22:15.", "set_alarm"),
    ("Hello! How are you?", None),
    ("Write a haiku about autumn leaves.", None),
    ("What is your name?", None),
    ("Tell me a joke about cats.", None),
    ("Translate 'good morning' into French.", None),
    ("Give me one tip for writing clear emails.", None),
]


DEFAULT_MODES = "required,auto,required_several"


def run_mode(llm: Any, mode: str, max_tokens: int, limit: int | None = None) -> list[dict[str, Any]]:
    """Every question under one tool_choice, in one batch; per question what came out."""
    from cachegw.backend.core.sampling_params import SamplingParams
    from cachegw.backend.entrypoints.tool_parser import HERMES
    from cachegw.backend.entrypoints.tool_prompt import chat_prompt_ids
    from cachegw.backend.entrypoints.tool_responses import tool_message
    from cachegw.backend.entrypoints.tools import tool_request
    from cachegw.protocol.requests import ChatMessage

    prompts, params, reqs = [], [], []
    for question, expected in QUESTIONS[:limit]:
        if mode == "named" and expected is None:
            continue
        named = {"type": "function", "function": {"name": expected}}
        req = tool_request({"tools": TOOLS, "tool_choice": named if mode == "named" else mode.split("_")[0]})
        assert req is not None
        messages = [ChatMessage.model_validate({"role": "user", "content": question})]
        prompts.append(chat_prompt_ids(llm.engine.tokenizer, messages, req))
        grammar_req = replace(req, templated=True) if mode == "required_several" else req
        params.append(SamplingParams(max_tokens=max_tokens, temperature=0, structured=grammar_req.grammar()))
        reqs.append((question, expected))
    outs = llm.generate(prompts, params)
    rows = []
    for (question, expected), out in zip(reqs, outs, strict=True):
        c = out.outputs[0]
        message, finish = tool_message(c.text, c.finish_reason, HERMES)
        calls = message.get("tool_calls") or []
        valid = bool(calls) and finish == "tool_calls"
        for call in calls:
            try:
                jsonschema.validate(
                    json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]]
                )
            except (ValueError, jsonschema.ValidationError, KeyError):
                valid = False
        rows.append({
            "question": question, "expected": expected, "finish": finish, "valid": valid,
            "calls": [(k["function"]["name"], k["function"]["arguments"]) for k in calls],
            "content": message.get("content"), "tokens": len(c.token_ids),
        })  # fmt: skip
    return rows


def share(rows: list[dict], ok: Any) -> float:
    return round(sum(1 for r in rows if ok(r)) / max(1, len(rows)), 3)


def summarize(mode: str, rows: list[dict]) -> dict[str, Any]:
    should = [r for r in rows if r["expected"] is not None]
    should_not = [r for r in rows if r["expected"] is None]
    right = share(should, lambda r: r["calls"] and r["calls"][0][0] == r["expected"])
    out: dict[str, Any] = {"answers": len(rows)}
    if mode == "auto":
        out |= {
            "calls_when_it_should": share(should, lambda r: bool(r["calls"])),
            "right_function_when_it_should": right,
            "text_when_it_should_not": share(should_not, lambda r: not r["calls"]),
        }
    else:
        out |= {
            "valid": share(rows, lambda r: r["valid"]),
            "right_function": right,
            "cut_by_max_tokens": share(rows, lambda r: r["finish"] == "length"),
            "mean_calls": round(sum(len(r["calls"]) for r in rows) / max(1, len(rows)), 2),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--max-tokens", type=int, default=80)
    parser.add_argument("--auto-tokens", type=int, default=16, help="max_tokens of the auto answers")
    parser.add_argument("--modes", default=DEFAULT_MODES)
    parser.add_argument("--several-questions", type=int, default=6, help="questions of required_several")
    args = parser.parse_args()

    from cachegw.backend import LLM

    llm = LLM(compile="off", dtype="float32", quantization="none", kv_cache_tokens=16384, max_num_seqs=32)
    result: dict[str, Any] = {"max_tokens": args.max_tokens, "auto_tokens": args.auto_tokens,
                              "questions": len(QUESTIONS)}  # fmt: skip
    for mode in args.modes.split(","):
        start = time.perf_counter()
        # auto: the first tokens say whether it calls (the call itself is what required checks)
        tokens = args.auto_tokens if mode == "auto" else args.max_tokens
        rows = run_mode(llm, mode, tokens, args.several_questions if "several" in mode else None)
        result[mode] = {
            **summarize(mode, rows),
            "seconds": round(time.perf_counter() - start, 1),
            "rows": rows,
        }
        say(f"{mode}: {json.dumps(summarize(mode, rows))}")
        # another set of modes goes to its own file, beside the default run's
        suffix = "" if args.modes == DEFAULT_MODES else "_" + args.modes.replace(",", "_")
        save(f"tool_calls{suffix}", result)


if __name__ == "__main__":
    main()
