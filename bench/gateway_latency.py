"""Gateway latency through real HTTP: semantic hits, the overhead a miss adds, hit throughput.

The built-in backend and the gateway run as their own processes (`cachegw backend`,
`cachegw serve`), the load comes from this one (httpx, asyncio), all on this machine.
- semantic-hit latency: p50/p99 of requests that differ from a stored one only in wording details
  (target p50 <= 15 ms);
- miss overhead: the same kind of request sent to the backend directly and through the gateway
  (paired, alternating order), and the gateway's own time (total - backend) from its request log
  (target p50 <= 15 ms);
- hit throughput: 32 concurrent clients repeating stored requests for a fixed time (target
  >= 300 req/s), against the backend answering the same requests.

    .venv/bin/python -m bench.gateway_latency [--seed-questions 40] [--seconds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.common import ROOT, pct, save, say

MODEL = "SmolLM2-135M-Instruct"
SYSTEM = "You are a helpful assistant. Answer in one short sentence."
QUESTIONS = [
    "How do I reset my password",
    "What is the capital of France",
    "How long does shipping take",
    "Can I change my delivery address",
    "How do I cancel my subscription",
    "What payment methods do you accept",
    "How do I contact customer support",
    "Where is my order",
    "How do I return an item",
    "Do you ship internationally",
    "How do I update my billing information",
    "What is your refund policy",
    "How do I create an account",
    "Why was my card declined",
    "How can I track my package",
    "What are your opening hours",
    "How do I apply a discount code",
    "Is my personal data safe",
    "How do I delete my account",
    "Can I pay in installments",
    "How do I change my email address",
    "What is the warranty on this product",
    "How do I reset my router",
    "Why is my internet slow",
    "How do I enable two-factor authentication",
    "What is the difference between plans",
    "How do I upgrade my plan",
    "How do I download my invoice",
    "Can I get a receipt",
    "How do I report a bug",
    "How do I unsubscribe from emails",
    "What is the delivery fee",
    "How do I change my username",
    "Can I transfer my license",
    "How do I restore a purchase",
    "Where can I find the user manual",
    "How do I set up notifications",
    "What happens if I miss a payment",
    "How do I verify my identity",
    "Can I order by phone",
]


def paraphrase(q: str) -> str:
    """What a second user types: other casing and punctuation (an exact-tier miss)."""
    return q[0].lower() + q[1:] + " ?"


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True
    )


def stop(proc: subprocess.Popen, grace: float = 30) -> None:
    """SIGTERM the process group ``start`` made, SIGKILL it after ``grace`` seconds."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


async def wait_health(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    async with httpx.AsyncClient(timeout=2) as c:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
            try:
                if (await c.get(f"{url}/health")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.3)
    raise RuntimeError(f"{url} did not become healthy")


def body(question: str, max_tokens: int = 16) -> dict:
    return {
        "model": MODEL,
        "temperature": 0,
        "max_tokens": max_tokens,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question + "?"}],
    }


async def timed(c: httpx.AsyncClient, url: str, payload: dict) -> tuple[float, str]:
    start = time.perf_counter()
    r = await c.post(url, json=payload, headers={"Authorization": "Bearer bench"})
    r.raise_for_status()
    return (time.perf_counter() - start) * 1e3, r.headers.get("x-cache", "")


async def hit_throughput(url: str, payloads: list[dict], clients: int, seconds: float) -> tuple[float, int]:
    done = 0
    stop = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=60, limits=limits) as c:

        async def worker(i: int) -> None:
            nonlocal done
            k = i
            while time.monotonic() < stop:
                await timed(c, url, payloads[k % len(payloads)])
                done += 1
                k += clients

        start = time.monotonic()
        await asyncio.gather(*(worker(i) for i in range(clients)))
        return done / (time.monotonic() - start), done


async def run(args: argparse.Namespace, work: Path) -> dict:
    bport, gport = 18401, 18400
    config = work / "cachegw.toml"
    cache = "" if args.cross_verifier else "[cache.verifier]\ncross_verifier = false\nthreshold = 0.80\n"
    config.write_text(
        f'[gateway]\nbackends = ["http://127.0.0.1:{bport}/v1"]\n'
        f'[engine]\nquantization = "none"\nmax_num_seqs = 32\ncompile = "off"\n{cache}'
    )
    exe = [sys.executable, "-m", "cachegw.gateway.cli"]
    backend = start([*exe, "backend", "--port", str(bport), "--config", str(config)], work / "backend.log")
    gw = start(
        [*exe, "serve", "--port", str(gport), "--config", str(config), "--data-dir", str(work / "data")],
        work / "gateway.log",
    )
    procs = [backend, gw]
    try:
        b_url, g_url = f"http://127.0.0.1:{bport}", f"http://127.0.0.1:{gport}"
        await wait_health(b_url, backend)
        await wait_health(g_url, gw)
        chat_g, chat_b = f"{g_url}/v1/chat/completions", f"{b_url}/v1/chat/completions"
        questions = QUESTIONS[: args.seed_questions]
        async with httpx.AsyncClient(timeout=120) as c:
            say(f"seeding the cache with {len(questions)} answers")
            for q in questions:
                await timed(c, chat_g, body(q))
            for q in questions:  # warm the exact path once
                await timed(c, chat_g, body(q))
            say("semantic hits, one at a time")
            sem, kinds = [], {}
            for _ in range(args.rounds):
                for q in questions:
                    ms, kind = await timed(c, chat_g, body(paraphrase(q)))
                    kinds[kind] = kinds.get(kind, 0) + 1
                    if kind == "semantic-hit":
                        sem.append(ms)
            say(f"paraphrase results: {kinds}")
            say("misses: direct to the backend and through the gateway, paired")
            direct, through = [], []
            for i in range(args.miss_pairs):
                a, b = (
                    body(f"Tell me fact number {i} about rivers", 1),
                    body(f"Tell me fact number {i} about lakes", 1),
                )
                pair = [(chat_b, a, direct), (chat_g, b, through)]
                for url, payload, out in pair if i % 2 == 0 else pair[::-1]:
                    out.append((await timed(c, url, payload))[0])
        exact_payloads = [body(q) for q in questions]
        say(f"hit throughput: {args.clients} clients for {args.seconds:.0f} s")
        hit_rps, n_hits = await hit_throughput(chat_g, exact_payloads, args.clients, args.seconds)
        say(f"the backend answering the same requests: {args.clients} clients for {args.seconds:.0f} s")
        backend_rps, _ = await hit_throughput(chat_b, exact_payloads, args.clients, args.seconds)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            p.wait(30)
    own = gateway_own_ms(work / "data" / "cachegw.db")
    stages = semantic_hit_stages(work / "data" / "cachegw.db")
    diffs = [t - d for t, d in zip(through, direct, strict=True)]
    return {
        "semantic_hit_ms": {
            "n": len(sem),
            "p50": round(pct(sem, 50), 2),
            "p99": round(pct(sem, 99), 2),
            "paraphrase_results": kinds,
            "inside_the_gateway_p50": stages,
        },
        "miss_overhead_ms": {
            "pairs": len(diffs),
            "paired_diff_p50": round(statistics.median(diffs), 2),
            "direct_p50": round(statistics.median(direct), 1),
            "through_p50": round(statistics.median(through), 1),
            "gateway_own_time_p50": round(pct(own, 50), 2) if own else None,
            "gateway_own_time_p99": round(pct(own, 99), 2) if own else None,
        },
        "hit_throughput": {
            "clients": args.clients,
            "seconds": args.seconds,
            "requests": n_hits,
            "gateway_hits_rps": round(hit_rps, 1),
            "backend_same_requests_rps": round(backend_rps, 1),
            "speedup": round(hit_rps / backend_rps, 1),
        },
        "targets": {"semantic_hit_p50_ms": "<= 15", "miss_overhead_p50_ms": "<= 15", "hit_rps": ">= 300"},
    }


def gateway_own_ms(db: Path) -> list[float]:
    """total - backend time of the gateway's misses, from its own request log."""
    with sqlite3.connect(db) as con:
        rows = con.execute(
            "SELECT total_ms - backend_ms FROM requests WHERE cache_result = 'miss'"
        ).fetchall()
    return [r[0] for r in rows if r[0] is not None]


def semantic_hit_stages(db: Path) -> dict[str, float]:
    """Where a semantic hit's time goes inside the gateway (its request log): embedding the query, the
    whole lookup (embedding, search, verifier) and the request from first byte to answer."""
    with sqlite3.connect(db) as con:
        rows = con.execute(
            "SELECT embed_ms, lookup_ms, total_ms FROM requests WHERE cache_result = 'semantic-hit'"
        ).fetchall()
    cols = list(zip(*rows, strict=True)) if rows else [[], [], []]
    names = ("embed_ms", "lookup_ms", "total_ms")
    return {n: round(statistics.median(c), 2) for n, c in zip(names, cols, strict=True) if c}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed-questions", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--miss-pairs", type=int, default=40)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument(
        "--no-cross-verifier",
        dest="cross_verifier",
        action="store_false",
        help="MLP-only verifier ([cache.verifier] cross_verifier = false, threshold 0.80): the stage's cost",
    )
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="cachegw-bench-") as tmp:
        result = asyncio.run(run(args, Path(tmp)))
    result["cross_verifier"] = args.cross_verifier
    save("gateway_latency" if args.cross_verifier else "gateway_latency_mlp_only", result)
    s, m, h = result["semantic_hit_ms"], result["miss_overhead_ms"], result["hit_throughput"]
    print(
        f"semantic hit p50 {s['p50']} ms p99 {s['p99']} ms | miss overhead p50 {m['paired_diff_p50']} ms "
        f"(own {m['gateway_own_time_p50']} ms) | hits {h['gateway_hits_rps']} req/s vs backend "
        f"{h['backend_same_requests_rps']} req/s"
    )


if __name__ == "__main__":
    os.chdir(ROOT)
    main()
