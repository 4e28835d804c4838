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
Then a slice of Mooncake's conversation trace (``--mooncake`` conversations of two turns or more, as
completions: each 512-token hash id becomes ``--mooncake-words`` seeded words, id 0, which starts every
request, eight times as many: the shared system prompt) under the same three modes.

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

from bench.common import SHARED_DATA, pct, save, say
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


def stream_once(http: httpx.Client, path: str, body: dict) -> tuple[float, str]:
    """A streamed request: (ms to its first text chunk, the whole text)."""
    t0, first, text = time.perf_counter(), None, []
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or []
            piece = (
                (choices[0].get("delta") or {}).get("content") or choices[0].get("text") if choices else None
            )
            if piece:
                first = first or time.perf_counter()
                text.append(piece)
    return ((first or time.perf_counter()) - t0) * 1e3, "".join(text)


def replay(url: str, tenant: int, system: str, turns: list[str], max_tokens: int) -> list[float]:
    """One conversation turn by turn, streamed, replies sent back; the TTFT of each turn in ms. An empty
    ``system`` means a completions trace: each turn is a whole prompt (Mooncake's requests)."""
    ttfts: list[float] = []
    history: list[dict] = []
    auth = {"Authorization": f"Bearer tenant-{tenant}"}
    with httpx.Client(base_url=url, timeout=900, headers=auth) as http:
        for turn in turns:
            body: dict = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0}
            if not system:
                ttfts.append(stream_once(http, "/v1/completions", {**body, "prompt": turn})[0])
                continue
            messages = [{"role": "system", "content": system}, *history, {"role": "user", "content": turn}]
            ttft, reply = stream_once(http, "/v1/chat/completions", {**body, "messages": messages})
            ttfts.append(ttft)
            history += [{"role": "user", "content": turn}, {"role": "assistant", "content": reply}]
    return ttfts


def mooncake(
    path: Path, conversations: int, tenants: int, words: int, max_ids: int
) -> list[tuple[int, str, list[str]]]:
    """A slice of Mooncake's trace as completions: conversations (requests sharing their first two hash
    ids) of two turns or more, drawn at random (seed 0), each request's prompt the text of its hash ids
    (``words`` seeded words per id; id 0, which every request starts with, is the shared system prompt),
    its first ``max_ids`` ids only. Tenants are dealt round robin."""
    with path.open() as f:
        rows = sorted((json.loads(line) for line in f), key=lambda r: r["timestamp"])
    turns: dict[tuple[int, ...], list[list[int]]] = {}
    for row in rows:
        turns.setdefault(tuple(row["hash_ids"][:2]), []).append(row["hash_ids"][:max_ids])
    keys = sorted(k for k, v in turns.items() if len(v) > 1)
    picked = random.Random(0).sample(keys, conversations)

    def text(h: int) -> str:
        rng = random.Random(h)
        return " ".join(rng.choice(WORDS) for _ in range(words * (8 if h == 0 else 1))) + "\n"

    return [
        (i % tenants, "", ["".join(text(h) for h in ids) for ids in turns[k]]) for i, k in enumerate(picked)
    ]


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
    ap.add_argument("--mooncake", type=int, default=12, help="Mooncake conversations (0 = none)")
    ap.add_argument("--mooncake-words", type=int, default=12, help="words per Mooncake hash id")
    ap.add_argument("--mooncake-ids", type=int, default=12, help="hash ids kept per Mooncake request")
    args = ap.parse_args()
    traces = {"synthetic": conversations(args.tenants, args.conversations, args.turns, args.system_words)}
    if args.mooncake:
        path = SHARED_DATA / "mooncake_conversation_trace.jsonl"
        traces["mooncake"] = mooncake(
            path, args.mooncake, args.tenants, args.mooncake_words, args.mooncake_ids
        )
    for name, convs in traces.items():
        say(f"{name}: {len(convs)} conversations, {sum(len(c[2]) for c in convs)} requests")
    runs: dict[str, dict[str, list[dict]]] = {t: {m: [] for m in MODES} for t in traces}
    with tempfile.TemporaryDirectory(prefix="cachegw-kvroute-") as tmp:
        work = Path(tmp)
        with engines(work, args.kv_tokens, args.concurrency + 1) as specs:
            urls = [s["url"] for s in specs]
            for rnd in range(args.rounds):
                for trace, convs in traces.items():
                    for mode in MODES:  # interleaved, so a drift of the shared machine hits all alike
                        data_dir = work / f"gw-{trace}-{mode}-{rnd}"
                        say(f"{trace}, mode {mode}, round {rnd + 1}/{args.rounds}")
                        t0 = time.perf_counter()
                        with (
                            gateway(specs, mode, data_dir) as gw,
                            ThreadPoolExecutor(args.concurrency) as pool,
                        ):
                            jobs = [pool.submit(replay, gw, t, s, u, args.max_tokens) for t, s, u in convs]
                            ttfts = [x for j in jobs for x in j.result()]
                            seconds = time.perf_counter() - t0
                            rows = logged(data_dir, len(ttfts))
                        run = summarize(rows, ttfts, urls, seconds)
                        runs[trace][mode].append(run)
                        say(f"{trace} {mode}: {run}")
    results = {trace: {m: median(rs) for m, rs in by_mode.items()} for trace, by_mode in runs.items()}
    ratios = {
        trace: {
            f"{m}_vs_round_robin": {
                "cached_share": round(
                    r["cached_over_prompt"] / max(res["round_robin"]["cached_over_prompt"], 1e-9), 2
                ),
                "ttft_p50": round(r["ttft_p50_ms"] / res["round_robin"]["ttft_p50_ms"], 2),
            }
            for m, r in res.items()
            if m != "round_robin"
        }
        for trace, res in results.items()
    }
    save("kv_routing", {"args": vars(args), "traces": results, "ratios": ratios})


def median(runs: list[dict]) -> dict:
    """Each figure's median over the rounds, and the rounds themselves."""
    keys = [k for k in runs[0] if isinstance(runs[0][k], int | float)]
    return {k: statistics.median(r[k] for r in runs) for k in keys} | {"rounds": runs}


if __name__ == "__main__":
    main()
