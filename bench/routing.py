"""Two backends behind one gateway: prefix routing against round-robin and a single backend.

Two `cachegw backend` processes (the real engine, one CPU thread each: a replica per core, as a replica
per GPU would be) sit behind one gateway with its response cache off, so every turn reaches a backend.
ShareGPT conversations with real system prompts (the same ones as bench/prefix_reuse.py) are replayed
turn by turn, several at once, under each routing mode:
- ``prefix`` (the default): a conversation's turns reach the backend that holds its prefix;
- ``round_robin``: what a plain load balancer does, no affinity;
- ``first``: everything on the first backend (what cachegw did before it routed at all).
Each mode sends its own ``cache_salt``, so no mode reuses another's KV blocks. Reported per mode: the
backends' cached_tokens / prompt_tokens on turns after the first, the share of requests each backend
took, the wall time of the replay and per-request latency.

    .venv/bin/python -m bench.routing [--conversations 16] [--turns 4] [--concurrency 4]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from bench.common import RESULTS, save, say
from bench.gateway_latency import start, wait_health
from bench.prefix_reuse import MODEL, load_conversations
from testkit.servers import serve_in_thread

MODES = ("prefix", "round_robin", "first")
PORTS = (18411, 18412)


@contextlib.contextmanager
def backends(work: Path, kv_tokens: int, concurrency: int) -> Iterator[list[str]]:
    config = work / "backend.toml"
    config.write_text(
        f'[engine]\nquantization = "none"\nkv_cache_tokens = {kv_tokens}\nmax_num_seqs = {concurrency}\n'
        'compile = "off"\n'
    )
    env_threads = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    os.environ.update(env_threads)  # inherited by the two processes: one core each
    procs = [
        start(
            [
                sys.executable,
                "-m",
                "cachegw.gateway.cli",
                "backend",
                "--port",
                str(p),
                "--config",
                str(config),
            ],
            work / f"backend-{p}.log",
        )
        for p in PORTS
    ]
    try:
        for p, proc in zip(PORTS, procs, strict=True):
            asyncio.run(wait_health(f"http://127.0.0.1:{p}", proc))
        yield [f"http://127.0.0.1:{p}/v1" for p in PORTS]
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)


@contextlib.contextmanager
def gateway(urls: list[str], mode: str, work: Path, name: str) -> Iterator[str]:
    from cachegw.gateway.api.app import build_app
    from cachegw.gateway.compose import started_gateway
    from cachegw.gateway.config import load_settings

    s = load_settings(None, data_dir=str(work / f"gw-{name}"), backends=tuple(urls))
    s = s.model_copy(
        update={
            "cache": s.cache.model_copy(update={"enabled": False}),
            "gateway": s.gateway.model_copy(update={"routing": mode}),
        }
    )
    with serve_in_thread(build_app(lambda: started_gateway(s, progress=False)), lifespan="on") as url:
        yield url


def replay(url: str, salt: str, system: str, users: list[str], max_tokens: int) -> list[dict]:
    """One conversation, turn by turn, replies sent back as received."""
    rows, history = [], []
    with httpx.Client(base_url=url, timeout=900, headers={"Authorization": "Bearer bench"}) as http:
        for k, user in enumerate(users, 1):
            messages = [{"role": "system", "content": system}, *history, {"role": "user", "content": user}]
            body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
            t0 = time.perf_counter()
            r = http.post("/v1/chat/completions", json={**body, "cache_salt": salt})
            r.raise_for_status()
            data = r.json()
            usage = data["usage"]
            rows.append(
                {
                    "turn": k,
                    "ms": (time.perf_counter() - t0) * 1e3,
                    "prompt": usage["prompt_tokens"],
                    "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
                }
            )
            reply = data["choices"][0]["message"]["content"]
            history += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    return rows


def backend_shares(work: Path, name: str, urls: list[str]) -> dict[str, float]:
    import sqlite3

    with sqlite3.connect(work / f"gw-{name}" / "cachegw.db") as db:
        used = Counter(b for (b,) in db.execute("SELECT backend FROM requests"))
    total = sum(used.values())
    shares = {f"backend_{i}": round(used[u] / max(total, 1), 3) for i, u in enumerate(urls)}
    return shares | {"logged_requests": total}


def summarize(rows: list[dict], seconds: float) -> dict:
    later = [r for r in rows if r["turn"] > 1]
    cached, prompt = sum(r["cached"] for r in later), sum(r["prompt"] for r in later)
    return {
        "requests": len(rows),
        "wall_s": round(seconds, 1),
        "later_turns_cached_over_prompt": round(cached / max(prompt, 1), 4),
        "later_turns_cached_tokens": cached,
        "later_turns_prompt_tokens": prompt,
        "latency_p50_ms": round(statistics.median(r["ms"] for r in rows), 1),
        "later_turns_latency_p50_ms": round(statistics.median(r["ms"] for r in later), 1),
    }


def median_run(runs: list[dict]) -> dict:
    """Each figure's median over the rounds, and the rounds themselves."""
    keys = [k for k in runs[0] if isinstance(runs[0][k], int | float)]
    return {k: round(statistics.median(r[k] for r in runs), 4) for k in keys} | {"rounds": runs}


def plot(results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(8, 3.4))
    names = list(results)
    axes[0].bar(names, [results[m]["later_turns_cached_over_prompt"] for m in names], color="tab:blue")
    axes[0].set(ylabel="cached / prompt tokens (turns 2+)", ylim=(0, 1))
    axes[1].bar(names, [results[m]["wall_s"] for m in names], color="tab:gray")
    axes[1].set(ylabel="replay wall time (s)")
    fig.suptitle("Two backends behind cachegw: routing modes (ShareGPT replay)", fontsize=10)
    fig.tight_layout()
    fig.savefig(RESULTS / "routing.png", dpi=120)
    say("wrote bench/results/routing.png")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-user-chars", type=int, default=600)
    ap.add_argument("--concurrency", type=int, default=4, help="conversations in flight")
    ap.add_argument("--kv-tokens", type=int, default=65536, help="KV capacity of each backend")
    ap.add_argument("--repeats", type=int, default=2, help="rounds of all modes, interleaved")
    args = ap.parse_args()
    convs = load_conversations(args.conversations, args.turns, args.max_user_chars)
    say(f"{len(convs)} conversations x {args.turns} turns, modes {', '.join(MODES)}")
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory(prefix="cachegw-routing-") as tmp:
        work = Path(tmp)
        with backends(work, args.kv_tokens, args.concurrency) as urls:
            say("warm-up: one conversation on each backend directly")
            for url in urls:
                replay(url.removesuffix("/v1"), "warm-up", *convs[0], args.max_tokens)
            for rep in range(args.repeats):  # modes interleaved, so a drift of the machine hits all alike
                for mode in MODES:
                    say(f"mode {mode}, round {rep + 1}/{args.repeats}")
                    t0 = time.perf_counter()
                    name = f"{mode}-{rep}"
                    with gateway(urls, mode, work, name) as gw, ThreadPoolExecutor(args.concurrency) as pool:
                        salt = f"routing-{name}"  # no run reuses another's KV blocks
                        jobs = [pool.submit(replay, gw, salt, s, u, args.max_tokens) for s, u in convs]
                        rows = [r for j in jobs for r in j.result()]
                    run = summarize(rows, time.perf_counter() - t0) | backend_shares(work, name, urls)
                    runs[mode].append(run)
                    say(f"{mode}: {run}")
    results = {m: median_run(rs) for m, rs in runs.items()}
    base = results["round_robin"]
    share = "later_turns_cached_over_prompt"
    ratios = {
        f"{m}_vs_round_robin": {
            "cached_share": round(r[share] / max(base[share], 1e-9), 2),
            "wall_time": round(r["wall_s"] / base["wall_s"], 2),
        }
        for m, r in results.items()
        if m != "round_robin"
    }
    save("routing", {"args": vars(args), "modes": results, "ratios": ratios})
    plot(results)


if __name__ == "__main__":
    main()
