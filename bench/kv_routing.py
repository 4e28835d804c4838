"""Three engines behind one gateway: KV-event routing against the rendezvous hash and round robin, then
the same after one engine restarts on the shared Redis tier.

Three `cachegw backend` processes (the real engine, SmolLM2 unquantized, one compute thread each, small KV
pools, each publishing its KV events, all three on one Redis KV tier with write-behind) sit behind the
gateway (response cache off, so every request reaches a backend). Two traces (``bench/kv_traces.py``):
a synthetic multi-tenant chat trace (tenants with their own API keys, so their own salts, each with a
long system prompt shared by its conversations; replies sent back) and a slice of Mooncake's
conversation trace as completions. Under each routing mode every conversation's turns but its last run
first; then engine 0 is stopped with SIGTERM (its pool written to Redis) and started again, and the last
turns run: the returning turns, after a restart. Reported per mode and phase, from the gateway's request
log and the streams: cached prompt tokens / prompt tokens, TTFT p50/p99 (first content chunk, through
the gateway), throughput (requests and tokens per second of the phase's wall time), where the requests
went, for ``kv`` why (prefix, load, hash), the tokens it expected against those reported, and the time
the gateway spent deciding (the ``/tokenize`` round trip most of it). Each mode has its own gateway and
data directory, so its own salts: no mode reuses another's blocks, in the pools or in Redis.

    flock /tmp/cachegw-bench.lock .venv/bin/python -m bench.kv_routing [--tenants 3] [--mooncake 8]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sqlite3
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from bench.common import SHARED_DATA, pct, save, say
from bench.gateway_latency import start, stop, wait_health
from bench.kv_traces import conversations, mooncake
from testkit.servers import free_port, redis_server, serve_in_thread

MODEL = "SmolLM2-135M-Instruct"
MODES = ("round_robin", "prefix", "kv")
ENGINES = 3
Conversation = tuple[int, str, list[str]]  # tenant, system prompt ("" = completions), user turns


class Engines:
    """Three engine processes, one compute thread each, on one Redis tier, each publishing KV events."""

    def __init__(self, work: Path, kv_tokens: int, max_seqs: int, redis_url: str) -> None:
        self.work = work
        self.cmds: list[list[str]] = []
        self.procs: list[Any] = []
        self.specs: list[dict] = []
        self.restarts = 0
        for i in range(ENGINES):
            port, events, replay = free_port(), free_port(), free_port()
            config = work / f"engine-{i}.toml"
            config.write_text(
                f'[engine]\nquantization = "none"\nkv_cache_tokens = {kv_tokens}\nmax_num_seqs = {max_seqs}\n'
                f'compile = "off"\nthreads = 1\ncpus = "all"\nkv_events_endpoint = "tcp://*:{events}"\n'
                f'kv_events_replay_endpoint = "tcp://*:{replay}"\nkv_offload_url = "{redis_url}"\n'
                "kv_write_behind = true\n"
            )
            self.cmds.append(
                [
                    sys.executable,
                    "-m",
                    "cachegw.gateway.cli",
                    "backend",
                    "--port",
                    str(port),
                    "--config",
                    str(config),
                ]
            )
            self.specs.append({"url": f"http://127.0.0.1:{port}/v1", "kv_events": f"tcp://127.0.0.1:{events}",
                               "kv_events_replay": f"tcp://127.0.0.1:{replay}"})  # fmt: skip
        self.procs = [start(cmd, work / f"engine-{i}.log") for i, cmd in enumerate(self.cmds)]
        for i in range(ENGINES):
            self._wait(i)

    def _wait(self, i: int) -> None:
        asyncio.run(wait_health(self.specs[i]["url"].removesuffix("/v1"), self.procs[i]))

    def restart(self, i: int) -> float:
        """SIGTERM engine ``i`` (its pool goes to Redis), start it again; seconds until it is healthy."""
        t0 = time.perf_counter()
        stop(self.procs[i])
        self.restarts += 1
        self.procs[i] = start(self.cmds[i], self.work / f"engine-{i}-restart{self.restarts}.log")
        self._wait(i)
        return time.perf_counter() - t0

    def close(self) -> None:
        for proc in self.procs:
            stop(proc)


@contextlib.contextmanager
def gateway(specs: list[dict], mode: str, data_dir: Path) -> Iterator[tuple[str, Any]]:
    """The gateway's URL and its started parts (for its KV router)."""
    from cachegw.gateway.api.app import build_app
    from cachegw.gateway.compose import started_gateway
    from cachegw.gateway.config import BackendSpec, load_settings

    s = load_settings(None, data_dir=str(data_dir), backends=tuple(BackendSpec(**b) for b in specs))
    s = s.model_copy(
        update={
            "cache": s.cache.model_copy(update={"enabled": False}),
            "gateway": s.gateway.model_copy(update={"routing": mode, "probe_interval_s": 0.5}),
        }
    )
    app = build_app(lambda: started_gateway(s, progress=False))
    with serve_in_thread(app, lifespan="on") as url:
        time.sleep(0.5)  # kv: subscribed and caught up by replay
        yield url, app.state.parts()


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


def replay(url: str, conv: Conversation, turns: range, history: list[dict], max_tokens: int) -> list[float]:
    """Turns ``turns`` of one conversation, streamed, replies appended to ``history`` (kept between
    phases); the TTFT of each turn in ms. An empty system prompt means completions (Mooncake's)."""
    tenant, system, users = conv
    ttfts: list[float] = []
    with httpx.Client(
        base_url=url, timeout=900, headers={"Authorization": f"Bearer tenant-{tenant}"}
    ) as http:
        for k in turns:
            body: dict = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0}
            if not system:
                ttfts.append(stream_once(http, "/v1/completions", {**body, "prompt": users[k]})[0])
                continue
            messages = [
                {"role": "system", "content": system},
                *history,
                {"role": "user", "content": users[k]},
            ]
            ttft, reply = stream_once(http, "/v1/chat/completions", {**body, "messages": messages})
            ttfts.append(ttft)
            history += [{"role": "user", "content": users[k]}, {"role": "assistant", "content": reply}]
    return ttfts


def logged(data_dir: Path, n: int) -> list[tuple]:
    query = (
        "SELECT backend, prompt_tokens, cached_tokens, route, expected_cached_tokens, completion_tokens"
        " FROM requests ORDER BY ts"
    )
    deadline = time.monotonic() + 10
    while True:
        with sqlite3.connect(data_dir / "cachegw.db") as db:
            rows = db.execute(query).fetchall()
        if len(rows) >= n or time.monotonic() > deadline:
            return rows
        time.sleep(0.1)


def summarize(rows: list[tuple], ttfts: list[float], urls: list[str], seconds: float) -> dict:
    prompt, cached = sum(r[1] or 0 for r in rows), sum(r[2] or 0 for r in rows)
    completion = sum(r[5] or 0 for r in rows)
    used = Counter(r[0] for r in rows)
    out: dict[str, Any] = {
        "requests": len(rows),
        "wall_s": round(seconds, 1),
        "cached_over_prompt": round(cached / max(prompt, 1), 4),
        "cached_tokens": cached,
        "prompt_tokens": prompt,
        "ttft_p50_ms": round(pct(ttfts, 50), 1),
        "ttft_p99_ms": round(pct(ttfts, 99), 1),
        "requests_per_s": round(len(rows) / seconds, 3),
        "tokens_per_s": round((prompt + completion) / seconds, 1),
        "share_per_engine": [round(used[u] / max(len(rows), 1), 3) for u in urls],
    }
    routed = [r for r in rows if r[3] is not None]
    if routed:
        out["kv_reasons"] = dict(Counter(r[3] for r in routed))
        out["kv_expected_cached_tokens"] = sum(r[4] or 0 for r in routed)
        out["kv_reported_cached_tokens"] = sum(r[2] or 0 for r in routed)
    return out


def tier_hits(urls: list[str]) -> Counter[str]:
    """Prefix-cache hit tokens by where they came from (pool, redis...), summed over the engines."""
    out: Counter[str] = Counter()
    for url in urls:
        for line in httpx.get(url.removesuffix("/v1") + "/metrics", timeout=30).text.splitlines():
            if line.startswith('cachegw:prefix_cache_hits_total{tier="'):
                out[line.split('"')[1]] += int(float(line.split()[-1]))
    return out


def run_phase(
    url: str, convs: list[Conversation], histories: list[list[dict]], last: bool, args: Any
) -> tuple:
    """Every conversation's turns but its last (``last`` False) or its last alone; (ttfts, seconds)."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        jobs = [
            pool.submit(replay, url, c, range(len(c[2]) - 1, len(c[2])) if last else range(len(c[2]) - 1),
                        h, args.max_tokens)
            for c, h in zip(convs, histories, strict=True)
        ]  # fmt: skip
        ttfts = [x for j in jobs for x in j.result()]
    return ttfts, time.perf_counter() - t0


def wait_known(kv: Any, url: str, restarts: int, timeout: float = 20) -> float:
    """Seconds from engine ``url`` being healthy again until the gateway saw its restart (its feed's
    restart count passed ``restarts``) and indexed blocks of its tier (-1: not within ``timeout``)."""
    feed = next(f for f in kv.feeds if f.url == url)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if feed.restarts > restarts and kv.tiered_blocks().get(url, 0) > 0:
            return round(time.perf_counter() - t0, 2)
        time.sleep(0.05)
    return -1.0


def one_mode(
    engines: Engines, trace: str, convs: list[Conversation], mode: str, work: Path, args: Any
) -> dict:
    urls = [s["url"] for s in engines.specs]
    data_dir = work / f"gw-{trace}-{mode}"
    histories: list[list[dict]] = [[] for _ in convs]
    with gateway(engines.specs, mode, data_dir) as (gw, parts):
        kv = parts.backends.kv
        hits = tier_hits(urls)
        before, before_s = run_phase(gw, convs, histories, False, args)
        n_before = len(before)
        rows = logged(data_dir, n_before)
        result = {"before": summarize(rows, before, urls, before_s)}
        result["before"]["hits_by_tier"] = dict(tier_hits(urls) - hits)
        restarts = next(f.restarts for f in kv.feeds if f.url == urls[0]) if kv is not None else 0
        restart_s = engines.restart(0)
        known_s = wait_known(kv, urls[0], restarts) if kv is not None else None
        time.sleep(1.0)  # the health probes see engine 0 up again
        hits = tier_hits(urls)  # engine 0's counters started again at 0
        after, after_s = run_phase(gw, convs, histories, True, args)
        rows = logged(data_dir, n_before + len(after))[n_before:]
        result["after_restart"] = summarize(rows, after, urls, after_s)
        result["after_restart"]["hits_by_tier"] = dict(tier_hits(urls) - hits)
        result["after_restart"] |= {"restart_s": round(restart_s, 1), "index_knew_tier_after_s": known_s}
        if kv is not None:
            routed = sum(kv.routes.values())
            result["gateway_decide_ms_per_request"] = round(1e3 * kv.decide_seconds / max(routed, 1), 2)
            result["after_restart"]["tiered_blocks_indexed"] = kv.tiered_blocks()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tenants", type=int, default=3)
    ap.add_argument("--conversations", type=int, default=2, help="per tenant")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--system-words", type=int, default=160, help="words of each tenant's system prompt")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=3, help="conversations in flight")
    ap.add_argument("--kv-tokens", type=int, default=3072, help="KV pool of each engine (tokens)")
    ap.add_argument("--mooncake", type=int, default=8, help="Mooncake conversations (0 = none)")
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
    results: dict[str, dict[str, dict]] = {t: {} for t in traces}
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="cachegw-kvroute-") as tmp, redis_server("4gb") as redis_url:
        work = Path(tmp)
        engines = Engines(work, args.kv_tokens, args.concurrency + 1, redis_url)
        try:
            for trace, convs in traces.items():
                for mode in MODES:  # interleaved per trace, so a drift of the shared machine hits all alike
                    say(f"{trace}, mode {mode}")
                    results[trace][mode] = one_mode(engines, trace, convs, mode, work, args)
                    say(f"{trace} {mode}: {results[trace][mode]}")
        finally:
            engines.close()
    ratios = {
        trace: {
            phase: {
                m: {
                    "cached_share": round(
                        r[phase]["cached_over_prompt"] / max(rr[phase]["cached_over_prompt"], 1e-9), 2
                    ),
                    "ttft_p50": round(r[phase]["ttft_p50_ms"] / rr[phase]["ttft_p50_ms"], 2),
                }
                for m, r in res.items()
                if m != "round_robin" and (rr := res["round_robin"])
            }
            for phase in ("before", "after_restart")
        }
        for trace, res in results.items()
    }
    save(
        "kv_routing",
        {"args": vars(args), "wall_s": round(time.time() - t0), "traces": results, "ratios": ratios},
    )


if __name__ == "__main__":
    main()
