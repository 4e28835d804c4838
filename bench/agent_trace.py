"""A multi-turn agent trace through `cachegw serve` at its defaults, sent three ways: as chat completions,
as Responses (the whole input each turn, as the OpenAI Agents SDK sends it), and as Anthropic Messages
with `cache_control` breakpoints on the system prompt and the newest turn.

Each turn is a long system prompt (a community prompt plus an agent's rules) with three tools and the
conversation so far; the answer goes back into the history as a client would send it. The three
shapes run interleaved turn by turn, each under its own tenant key (tenants never share the backend's
prefix cache), and every request streams, so time to first token (TTFT) is measured as a client sees
it. Per turn: the prompt tokens, the tokens the engine served from its prefix cache, TTFT.

Three phases:
- ``calm``: the trace alone: prefix caching across turns;
- ``pressure``: between turns, unrelated prompts of one other tenant fill the engine's whole KV pool
  (``--flood`` times its size), so only what a pin protects survives to the next turn;
- ``replay``: the calm trace again: every turn is an exact hit of the gateway's own cache.

    .venv/bin/python -m bench.agent_trace  [--turns 6] [--flood 1.3]
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import ROOT, SHARED_DATA, save, say
from bench.gateway_latency import start, stop, wait_health

MODEL = "SmolLM2-135M-Instruct"
SHAPES = ("chat", "responses", "messages")
PORT, ENGINE_PORT = 18470, 18471
QUESTIONS = [
    "Which files should I look at first to understand this project?",
    "Summarize what the build script does.",
    "Is there a test for the parser? Answer briefly.",
    "What would you change first, and why?",
    "Write a one-line commit message for that change.",
    "Any risks before we merge?",
    "Which reviewer should see it?",
    "Thanks. Anything else?",
]
RULES = (
    "You are a coding agent working in a user's repository. Use the tools to read files, search the code "
    "and run commands; never invent file contents. Keep answers short and concrete. When you are unsure, "
    "say so and name the file you would read next. "
)
TOOLS = [
    ("read_file", "Read a file of the repository.", {"path": {"type": "string"}}),
    ("search_code", "Search the repository for a string.", {"query": {"type": "string"}}),
    ("run_command", "Run a shell command in the repository.", {"command": {"type": "string"}}),
]


def system_prompt() -> str:
    """A long agent prompt: a community system prompt of 1,500-2,500 characters plus the agent's rules."""
    csv.field_size_limit(sys.maxsize)
    with open(SHARED_DATA / "system_prompts.csv", newline="") as f:
        prompt = next(r["prompt"] for r in csv.DictReader(f) if 1500 <= len(r["prompt"]) <= 2500)
    return RULES * 3 + prompt


def schema(props: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props)}


def request(shape: str, system: str, history: list[dict[str, str]], max_tokens: int) -> tuple[str, dict]:
    """(path, body) of one turn in ``shape``: ``history`` holds the turns so far as role/content pairs."""
    if shape == "chat":
        tools = [
            {"type": "function", "function": {"name": n, "description": d, "parameters": schema(p)}}
            for n, d, p in TOOLS
        ]
        messages = [{"role": "system", "content": system}, *history]
        body = {
            "model": MODEL,
            "messages": messages,
            "tools": tools,
            "temperature": 0,
            "max_tokens": max_tokens,
        }
        return "/v1/chat/completions", {**body, "stream": True, "stream_options": {"include_usage": True}}
    if shape == "responses":
        tools = [
            {"type": "function", "name": n, "description": d, "parameters": schema(p)} for n, d, p in TOOLS
        ]
        body = {"model": MODEL, "instructions": system, "input": history, "tools": tools, "temperature": 0}
        return "/v1/responses", {**body, "max_output_tokens": max_tokens, "stream": True}
    tools = [{"name": n, "description": d, "input_schema": schema(p)} for n, d, p in TOOLS]
    messages: list[dict[str, Any]] = [dict(m) for m in history]
    last = messages[-1]
    last["content"] = [{"type": "text", "text": last["content"], "cache_control": {"type": "ephemeral"}}]
    system_blocks = [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}]
    body = {"model": MODEL, "system": system_blocks, "messages": messages, "tools": tools, "temperature": 0}
    return "/v1/messages", {**body, "max_tokens": max_tokens, "stream": True}


def usage_of(shape: str, events: list[dict[str, Any]]) -> tuple[int, int, int]:
    """(prompt tokens, read from the prefix cache, written under a pin) from a stream's events."""
    prompt = cached = written = 0
    for e in events:
        u = e.get("usage") or (e.get("response") or {}).get("usage") or (e.get("message") or {}).get("usage")
        if not isinstance(u, dict):
            continue
        if shape == "chat":
            details = u.get("prompt_tokens_details") or {}
            prompt, cached = u.get("prompt_tokens") or prompt, details.get("cached_tokens") or cached
            written = details.get("pinned_tokens", 0) and max(0, details["pinned_tokens"] - cached)
        elif shape == "responses":
            details = u.get("input_tokens_details") or {}
            prompt, cached = u.get("input_tokens") or prompt, details.get("cached_tokens") or cached
            written = details.get("cache_write_tokens") or written
        else:
            read, made = u.get("cache_read_input_tokens"), u.get("cache_creation_input_tokens")
            if u.get("input_tokens") is not None and read is not None:
                prompt, cached, written = u["input_tokens"] + read + (made or 0), read, made or 0
    return prompt, cached, written


def text_of(shape: str, e: dict[str, Any]) -> str:
    if shape == "chat":
        return "".join((c.get("delta") or {}).get("content") or "" for c in e.get("choices") or [])
    if shape == "responses":
        return e.get("delta", "") if e.get("type") == "response.output_text.delta" else ""
    delta = e.get("delta") or {}
    return delta.get("text", "") if e.get("type") == "content_block_delta" else ""


async def turn(c: httpx.AsyncClient, url: str, shape: str, key: str, path: str, body: dict) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {key}", "x-api-key": key}
    t0 = time.perf_counter()
    ttft, events, text = None, [], ""
    async with c.stream("POST", url + path, json=body, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{shape}: {r.status_code} {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            e = json.loads(line[5:])
            events.append(e)
            piece = text_of(shape, e)
            if piece and ttft is None:
                ttft = time.perf_counter() - t0
            text += piece
        cache = r.headers.get("x-cache")
    prompt, cached, written = usage_of(shape, events)
    total = time.perf_counter() - t0
    return {
        "x_cache": cache,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "written_tokens": written,
        "ttft_ms": round(1e3 * (ttft if ttft is not None else total), 1),
        "total_ms": round(1e3 * total, 1),
        "text": text,
    }


async def flood(c: httpx.AsyncClient, url: str, tokens: int, salt: str) -> None:
    """Unrelated prompts of another tenant, about ``tokens`` prompt tokens in all, never cached."""
    sent, i = 0, 0
    while sent < tokens:
        filler = f"Case {salt}-{i}: " + " ".join(f"item{salt}{i}x{j}" for j in range(300))
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": filler}],
            "temperature": 0,
            "max_tokens": 1,
        }
        r = await c.post(
            url + "/v1/chat/completions",
            json=body,
            headers={"Authorization": "Bearer flood", "Cache-Control": "no-store"},
        )
        r.raise_for_status()
        sent += r.json()["usage"]["prompt_tokens"]
        i += 1


async def trace(
    c: httpx.AsyncClient, url: str, phase: str, args: argparse.Namespace, pool_tokens: int
) -> list[dict]:
    system = system_prompt()
    histories: dict[str, list[dict[str, str]]] = {s: [] for s in SHAPES}
    rows = []
    for t in range(args.turns):
        if phase == "pressure" and t > 0:
            say(f"{phase}: turn {t + 1}: filling the KV pool ({int(args.flood * pool_tokens)} tokens)")
            await flood(c, url, int(args.flood * pool_tokens), f"{t}")
        order = SHAPES[t % 3 :] + SHAPES[: t % 3]  # who goes first rotates: no shape always warms the engine
        for shape in order:
            history = histories[shape]
            history.append({"role": "user", "content": QUESTIONS[t % len(QUESTIONS)]})
            path, body = request(shape, system, history, args.max_tokens)
            key = f"{phase if phase != 'replay' else 'calm'}-{shape}"
            row = await turn(c, url, shape, key, path, body)
            history.append({"role": "assistant", "content": row.pop("text") or "OK."})
            rows.append({"phase": phase, "turn": t + 1, "shape": shape, **row})
            say(f"{phase} turn {t + 1} {shape}: {rows[-1]}")
    return rows


def config_file(work: Path) -> Path:
    """The repository's config.toml with only the ports changed."""
    text = (ROOT / "config.toml").read_text()
    text = text.replace("port = 8000\n", f"port = {PORT}\n", 1).replace(
        "port = 8001", f"port = {ENGINE_PORT}", 1
    )
    path = work / "config.toml"
    path.write_text(text)
    return path


async def run(args: argparse.Namespace) -> dict:
    work = Path(tempfile.mkdtemp(prefix="agent-trace-"))
    cmd = [
        sys.executable,
        "-m",
        "cachegw.gateway.cli",
        "serve",
        "--config",
        str(config_file(work)),
        "--data-dir",
        str(work / "data"),
    ]
    proc = start(cmd, work / "serve.log")
    url = f"http://127.0.0.1:{PORT}"
    try:
        t0 = time.monotonic()
        await wait_health(url, proc, timeout=900)
        say(f"gateway healthy after {time.monotonic() - t0:.0f} s")
        async with httpx.AsyncClient(timeout=600) as c:
            pool_tokens = pool_tokens_of((work / "serve.log").read_text())
            say(f"the engine's KV pool: {pool_tokens} tokens")
            rows: list[dict] = []
            for phase in ("calm", "pressure", "replay"):
                rows += await trace(c, url, phase, args, pool_tokens)
    finally:
        stop(proc, 60)
    return {"pool_tokens": pool_tokens, "rows": rows, "summary": summarize(rows)}


def pool_tokens_of(log: str) -> int:
    """The engine's KV pool in tokens, from its start-up line ("2912 KV blocks x 16 tokens")."""
    found = re.search(r"(\d+) KV blocks x (\d+) tokens", log)
    if found is None:
        raise RuntimeError("the engine's start-up line did not say its KV pool")
    return int(found[1]) * int(found[2])


def summarize(rows: list[dict]) -> dict:
    out: dict[str, dict] = {}
    for phase in ("calm", "pressure", "replay"):
        for shape in SHAPES:
            mine = [r for r in rows if r["phase"] == phase and r["shape"] == shape and r["turn"] > 1]
            if not mine:
                continue
            prompt = sum(r["prompt_tokens"] for r in mine)
            out[f"{phase}/{shape}"] = {
                "turns_2_on": len(mine),
                "prompt_tokens": prompt,
                "cached_share": round(sum(r["cached_tokens"] for r in mine) / prompt, 3) if prompt else None,
                "ttft_ms_mean": round(sum(r["ttft_ms"] for r in mine) / len(mine), 1),
                "hits": sum(r["x_cache"] in ("exact-hit", "semantic-hit") for r in mine),
            }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument(
        "--flood", type=float, default=1.3, help="KV pools' worth of unrelated prompts between turns"
    )
    args = p.parse_args()
    result = asyncio.run(run(args))
    save("agent_trace", {"args": vars(args), **result})
    plot(result["rows"])


def plot(rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6), sharey=True)
    for ax, phase in zip(axes, ("calm", "pressure", "replay"), strict=True):
        for shape in SHAPES:
            mine = [r for r in rows if r["phase"] == phase and r["shape"] == shape]
            ax.plot([r["turn"] for r in mine], [r["ttft_ms"] for r in mine], marker="o", label=shape)
        ax.set_title(phase)
        ax.set_xlabel("turn")
        ax.set_yscale("log")
    axes[0].set_ylabel("TTFT (ms)")
    axes[0].legend()
    fig.tight_layout()
    out = ROOT / "bench" / "results" / "agent_trace.png"
    fig.savefig(out, dpi=110)
    say(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
