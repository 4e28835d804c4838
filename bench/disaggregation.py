"""Decode inter-token latency while long prompts arrive: one engine doing both against a prefill/decode pair.

Real `cachegw backend` processes on the embedded SmolLM2 (compile off, one thread per core): `single` is one
engine (role both) on one core; `single2` the same engine on both cores; `pair` a decode engine on core 0
with a prefill engine on core 1, handing prompts over through a shared folder in /dev/shm (or a throwaway
Redis with ``--tier redis``). Each round, per layout, after a 300-token warm-up prompt: ``--streams``
streams decode (short prompts, greedy, no stop) for a second, then ``--longs`` prompts of ``--tokens``
random token ids arrive ``--gap`` s apart, each answered with 8 greedy tokens; once they are done the
streams are closed. The streams' inter-token gaps (as the client receives them) while long prompts are
in flight give the p50/p99/max; the long prompts' time to first token and greedy texts (which must
equal across layouts) are recorded too, and the warm-up's text, answered alone in every layout. With
the default int4 weights in bfloat16, a step's numbers depend on which rows share it, so a long prompt
computed beside the streams (one engine) may answer other greedy tokens than one computed alone (the
prefill engine); the warm-up, alone everywhere, checks the handover itself. Layouts alternate within a
round, rounds repeat.

    flock /tmp/cachegw-bench.lock .venv/bin/python -m bench.disaggregation [--rounds 2] [--tier disk]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx

from bench.common import pct, save, say
from testkit.backend_process import BackendProcess, start_backend
from testkit.servers import redis_server

PORTS = iter(range(18110, 18199))  # this benchmark's own range


def config(folder: Path, name: str, **engine: Any) -> Path:
    keys = {"compile": "off", "threads": 0, **engine}
    lines = [f"{k} = {json.dumps(v)}" for k, v in keys.items()]  # JSON's strings and numbers are TOML's
    path = folder / f"{name}.toml"
    path.write_text("[engine]\n" + "\n".join(lines) + "\n")
    return path


@contextmanager
def layout(name: str, folder: Path, tier: dict[str, Any], logs: Path) -> Iterator[BackendProcess]:
    """The engine(s) of a layout; yields the one clients talk to."""
    log = logs / f"{name}.log"
    with ExitStack() as stack:
        if name == "pair":
            prefill_cfg = config(folder, "prefill", role="prefill", **tier)
            prefill = start_backend(prefill_cfg, log, next(PORTS), "--cpus", "1")
            stack.callback(prefill.stop)
            decode_cfg = config(
                folder, "decode", role="decode", prefill_url=prefill.url, kv_offload_bytes=512 << 20, **tier
            )
            front = start_backend(decode_cfg, log, next(PORTS), "--cpus", "0")
        else:
            cpus = "0-1" if name == "single2" else "0"
            front = start_backend(config(folder, name), log, next(PORTS), "--cpus", cpus)
        stack.callback(front.stop)
        yield front


async def stream(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], stop: asyncio.Event | None = None
) -> tuple[list[float], str]:
    """The arrival time of every streamed token and the text; closed early once ``stop`` is set."""
    times, text = [], ""
    async with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices") or []:
                times.append(time.perf_counter())
                text += choice.get("text") or ""
            if stop is not None and stop.is_set():
                break
    return times, text


async def one_round(url: str, model: str, args: argparse.Namespace, longs: list[list[int]]) -> dict[str, Any]:
    greedy = {"model": model, "temperature": 0, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=900) as client:
        warm = [random.Random(-1).randrange(100, 49000) for _ in range(300)]  # long enough to be handed over
        _, warm_text = await stream(client, url, {**greedy, "prompt": warm, "max_tokens": 8})
        stop = asyncio.Event()
        story = {**greedy, "max_tokens": 4000}
        stories = [{**story, "prompt": f"Story {i}: once upon a time"} for i in range(args.streams)]
        streams = [asyncio.create_task(stream(client, url, body, stop)) for body in stories]
        await asyncio.sleep(1.0)
        window_start = time.perf_counter()
        tasks = []
        for prompt in longs:
            sent = time.perf_counter()
            body = {**greedy, "prompt": prompt, "max_tokens": 8}
            tasks.append((sent, asyncio.create_task(stream(client, url, body))))
            await asyncio.sleep(args.gap)
        answers = [(sent, await task) for sent, task in tasks]
        window_end = time.perf_counter()
        stop.set()
        token_times = [(await s)[0] for s in streams]
        metrics = (await client.get(f"{url}/metrics")).text
    gaps_in, gaps_before = [], []
    for times in token_times:
        for a, b in zip(times, times[1:], strict=False):
            if window_start <= b <= window_end:
                gaps_in.append(b - a)
            elif b < window_start:
                gaps_before.append(b - a)
    ttfts = [times[0] - sent for sent, (times, _) in answers]
    return {
        "itl_ms": _summary(gaps_in),
        "itl_before_ms": _summary(gaps_before),
        "long_ttft_s": [round(t, 2) for t in ttfts],
        "texts": [text for _, (_, text) in answers],
        "warm_text": warm_text,
        "handovers": _family(metrics, "cachegw:prefill_handovers_total"),
        "prefix_hits_by_tier": _family(metrics, "cachegw:prefix_cache_hits_total"),
    }


def _family(metrics: str, name: str) -> dict[str, float]:
    """A labelled family's values from a /metrics page, by its one label's value."""
    lines = [line for line in metrics.splitlines() if line.startswith(name + "{")]
    return {line.split('"')[1]: float(line.split()[-1]) for line in lines}


def _summary(gaps: list[float]) -> dict[str, float]:
    if not gaps:
        return {"n": 0}
    ms = [g * 1e3 for g in gaps]
    return {"n": len(ms), "p50": round(pct(ms, 50), 1), "p99": round(pct(ms, 99), 1), "max": round(max(ms))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--streams", type=int, default=2)
    ap.add_argument("--longs", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=1800)
    ap.add_argument("--gap", type=float, default=2.0, help="seconds between long prompts")
    ap.add_argument("--tier", choices=("disk", "redis"), default="disk")
    ap.add_argument("--layouts", default="single,pair,single2")
    ap.add_argument("--logs", default="", help="folder for the engines' logs (default: a temporary one)")
    args = ap.parse_args()
    names = args.layouts.split(",")
    rows: list[dict[str, Any]] = []
    with ExitStack() as stack:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="disagg-", dir="/dev/shm")))
        if args.tier == "redis":
            tier: dict[str, Any] = {"kv_offload_url": stack.enter_context(redis_server("2gb"))}
        else:
            tier = {"kv_offload_dir": str(folder / "kv")}
        for rnd in range(args.rounds):
            rng = random.Random(rnd)
            longs = [[rng.randrange(100, 49000) for _ in range(args.tokens)] for _ in range(args.longs)]
            for name in names if rnd % 2 == 0 else reversed(names):
                with layout(name, folder, tier, Path(args.logs or folder)) as front:
                    measured = asyncio.run(one_round(front.url, front.model, args, longs))
                row = {"round": rnd, "layout": name, **measured}
                say(json.dumps({k: v for k, v in row.items() if k != "texts"}))
                rows.append(row)
            this_round = [r for r in rows if r["round"] == rnd]
            for entry in this_round:  # greedy: is every layout's answer the first layout's?
                entry["same_texts"] = entry["texts"] == this_round[0]["texts"]
                entry["same_warm_text"] = entry["warm_text"] == this_round[0]["warm_text"]
    summary: dict[str, Any] = {
        "same_warm_texts": all(r["same_warm_text"] for r in rows),  # answered alone
        "same_texts_under_load": all(r["same_texts"] for r in rows),  # computed beside the streams
    }
    for name in names:
        mine = [r for r in rows if r["layout"] == name]
        summary[name] = {
            "itl_p50_ms": round(sum(r["itl_ms"]["p50"] for r in mine) / len(mine), 1),
            "itl_p99_ms": round(sum(r["itl_ms"]["p99"] for r in mine) / len(mine), 1),
            "itl_max_ms": max(r["itl_ms"]["max"] for r in mine),
            "itl_before_p50_ms": round(sum(r["itl_before_ms"]["p50"] for r in mine) / len(mine), 1),
            "long_ttft_mean_s": round(sum(sum(r["long_ttft_s"]) for r in mine) / (len(mine) * args.longs), 2),
        }
    say(json.dumps(summary))
    save("disaggregation", {"summary": summary, "rows": rows, "args": vars(args)})


if __name__ == "__main__":
    main()
