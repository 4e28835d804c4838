"""Two engines behind one gateway: KV-event routing against the rendezvous hash and round robin.

Two `cachegw backend` processes (the real engine, SmolLM2 float32, one compute thread each, small KV
pools, each publishing its KV events) sit behind the gateway (response cache off, so every request
reaches a backend). A synthetic multi-tenant trace is replayed under each routing mode: ``--tenants``
tenants (their own API keys, so their own salts), each with its own long system prompt shared by its
``--conversations`` conversations of ``--turns`` turns; conversations run ``--concurrency`` at a time,
turn by turn, with the assistant's replies sent back. Reported per mode, from the gateway's request log
and the streams: cached prompt tokens / prompt tokens, TTFT p50 (first content chunk, through the
gateway), where the requests went, and for ``kv`` why (prefix, load, hash) and the tokens it expected
against those the engines reported cached. Modes are interleaved per round; each gateway has its own
data directory, so its own salts: no mode reuses another's blocks.

    flock /tmp/cachegw-bench.lock .venv/bin/python -m bench.kv_routing [--rounds 1] [--tenants 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sqlite3
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from bench.common import pct, save, say
from bench.gateway_latency import start, stop, wait_health
from testkit.servers import free_port, serve_in_thread

MODEL = "SmolLM2-135M-Instruct"
MODES = ("round_robin", "prefix", "kv")
TOPICS = ("a public library", "a bicycle repair shop", "a mountain hut", "a city museum", "a ferry line")
WORDS = (
    "opening hours members borrow renew reserve catalogue card fee children parents reading room quiet "
    "printing colour computers network bookings weekends holidays tickets refunds lockers cafe garden "
    "exhibition guided tours groups schools discounts accessibility lifts parking bicycles timetable"
).split()


def system_prompt(tenant: int, words: int) -> str:
    rng = random.Random(tenant)
    rules = " ".join(rng.choice(WORDS) for _ in range(words))
    place = TOPICS[tenant % len(TOPICS)]
    return f"You are the assistant of {place}. Answer in one short sentence. Notes: {rules}."


def conversations(tenants: int, per_tenant: int, turns: int, words: int) -> list[tuple[int, str, list[str]]]:
    """(tenant, system prompt, user turns) for every conversation, tenants interleaved."""
    out = []
    for c in range(per_tenant):
        for t in range(tenants):
            rng = random.Random(1000 * t + c)
            users = [
                f"Question {k + 1}: " + " ".join(rng.choice(WORDS) for _ in range(12)) + "?"
                for k in range(turns)
            ]
            out.append((t, system_prompt(t, words), users))
    return out


@contextlib.contextmanager
def engines(work: Path, kv_tokens: int, max_seqs: int) -> Iterator[list[dict]]:
    """Two engine processes, one compute thread each, each publishing KV events with replay."""
    procs, specs = [], []
    try:
        for i in range(2):
            port, events, replay = free_port(), free_port(), free_port()
            config = work / f"engine-{i}.toml"
            config.write_text(
                f'[engine]\nquantization = "none"\nkv_cache_tokens = {kv_tokens}\nmax_num_seqs = {max_seqs}\n'
                f'compile = "off"\nthreads = 1\ncpus = "all"\nkv_events_endpoint = "tcp://*:{events}"\n'
                f'kv_events_replay_endpoint = "tcp://*:{replay}"\n'
            )
            cmd = [
                sys.executable,
                "-m",
                "cachegw.gateway.cli",
                "backend",
                "--port",
                str(port),
                "--config",
                str(config),
            ]
            procs.append(start(cmd, work / f"engine-{i}.log"))
            url = f"http://127.0.0.1:{port}"
            specs.append({"url": f"{url}/v1", "kv_events": f"tcp://127.0.0.1:{events}",
                          "kv_events_replay": f"tcp://127.0.0.1:{replay}"})  # fmt: skip
        for spec, proc in zip(specs, procs, strict=True):
            asyncio.run(wait_health(spec["url"].removesuffix("/v1"), proc))
        yield specs
    finally:
        for proc in procs:
            stop(proc)


@contextlib.contextmanager
def gateway(specs: list[dict], mode: str, data_dir: Path) -> Iterator[str]:
    from cachegw.gateway.api.app import build_app
    from cachegw.gateway.compose import started_gateway
    from cachegw.gateway.config import BackendSpec, load_settings

    s = load_settings(None, data_dir=str(data_dir), backends=tuple(BackendSpec(**b) for b in specs))
    s = s.model_copy(
        update={
            "cache": s.cache.model_copy(update={"enabled": False}),
            "gateway": s.gateway.model_copy(update={"routing": mode}),
        }
    )
    with serve_in_thread(build_app(lambda: started_gateway(s, progress=False)), lifespan="on") as url:
        time.sleep(0.5)  # kv: subscribed and caught up by replay
        yield url


def replay(url: str, tenant: int, system: str, users: list[str], max_tokens: int) -> list[float]:
    """One conversation turn by turn (streamed); the TTFT of each turn in ms."""
    ttfts: list[float] = []
    history: list[dict] = []
    with httpx.Client(
        base_url=url, timeout=900, headers={"Authorization": f"Bearer tenant-{tenant}"}
    ) as http:
        for user in users:
            messages = [{"role": "system", "content": system}, *history, {"role": "user", "content": user}]
            body = {
                "model": MODEL,
                "messages": messages,
                "max_tokens": max_tokens,
                "temperature": 0,
                "stream": True,
            }
            t0, first, text = time.perf_counter(), None, []
            with http.stream("POST", "/v1/chat/completions", json=body) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    choices = json.loads(line[6:]).get("choices") or []
                    delta = (choices[0].get("delta") or {}).get("content") if choices else None
                    if delta:
                        first = first or time.perf_counter()
                        text.append(delta)
            ttfts.append(((first or time.perf_counter()) - t0) * 1e3)
            history += [{"role": "user", "content": user}, {"role": "assistant", "content": "".join(text)}]
    return ttfts


def logged(data_dir: Path, n: int) -> list[tuple]:
    query = "SELECT backend, prompt_tokens, cached_tokens, route, expected_cached_tokens FROM requests"
    deadline = time.monotonic() + 10
    while True:
        with sqlite3.connect(data_dir / "cachegw.db") as db:
            rows = db.execute(query).fetchall()
        if len(rows) >= n or time.monotonic() > deadline:
            return rows
        time.sleep(0.1)


def summarize(rows: list[tuple], ttfts: list[float], urls: list[str], seconds: float) -> dict:
    prompt, cached = sum(r[1] or 0 for r in rows), sum(r[2] or 0 for r in rows)
    used = Counter(r[0] for r in rows)
    out = {
        "requests": len(rows),
        "wall_s": round(seconds, 1),
        "cached_over_prompt": round(cached / max(prompt, 1), 4),
        "cached_tokens": cached,
        "prompt_tokens": prompt,
        "ttft_p50_ms": round(pct(ttfts, 50), 1),
        "ttft_p90_ms": round(pct(ttfts, 90), 1),
        "share_backend_0": round(used[urls[0]] / max(len(rows), 1), 3),
    }
    routed = [r for r in rows if r[3] is not None]
    if routed:
        out["kv_reasons"] = dict(Counter(r[3] for r in routed))
        out["kv_expected_cached_tokens"] = sum(r[4] or 0 for r in routed)
        out["kv_reported_cached_tokens"] = sum(r[2] or 0 for r in routed)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tenants", type=int, default=3)
    ap.add_argument("--conversations", type=int, default=4, help="per tenant")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--system-words", type=int, default=160, help="words of each tenant's system prompt")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=3, help="conversations in flight")
    ap.add_argument("--kv-tokens", type=int, default=3072, help="KV pool of each engine (tokens)")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of all modes, interleaved")
    args = ap.parse_args()
    convs = conversations(args.tenants, args.conversations, args.turns, args.system_words)
    say(f"{len(convs)} conversations x {args.turns} turns, {args.tenants} tenants, modes {', '.join(MODES)}")
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory(prefix="cachegw-kvroute-") as tmp:
        work = Path(tmp)
        with engines(work, args.kv_tokens, args.concurrency + 1) as specs:
            urls = [s["url"] for s in specs]
            for rnd in range(args.rounds):
                for mode in MODES:
                    data_dir = work / f"gw-{mode}-{rnd}"
                    say(f"mode {mode}, round {rnd + 1}/{args.rounds}")
                    t0 = time.perf_counter()
                    with gateway(specs, mode, data_dir) as gw, ThreadPoolExecutor(args.concurrency) as pool:
                        jobs = [pool.submit(replay, gw, t, s, u, args.max_tokens) for t, s, u in convs]
                        ttfts = [x for j in jobs for x in j.result()]
                        seconds = time.perf_counter() - t0
                        rows = logged(data_dir, len(ttfts))
                    run = summarize(rows, ttfts, urls, seconds)
                    runs[mode].append(run)
                    say(f"{mode}: {run}")
    results = {
        m: {k: statistics.median(r[k] for r in rs) for k in rs[0] if isinstance(rs[0][k], int | float)}
        | {"rounds": rs}
        for m, rs in runs.items()
    }
    base = results["round_robin"]
    ratios = {
        f"{m}_vs_round_robin": {
            "cached_share": round(r["cached_over_prompt"] / max(base["cached_over_prompt"], 1e-9), 2),
            "ttft_p50": round(r["ttft_p50_ms"] / base["ttft_p50_ms"], 2),
        }
        for m, r in results.items()
        if m != "round_robin"
    }
    save("kv_routing", {"args": vars(args), "modes": results, "ratios": ratios})


if __name__ == "__main__":
    main()
