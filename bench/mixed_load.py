"""`cachegw serve` under mixed traffic: the engine decoding for 8 clients while the gateway answers
semantic hits at a steady rate, in layouts of the gateway and its built-in engine on this machine.

- before: what `make serve` did before the core split (now `[engine] cpus`) and the engine's thread
  settings existed: gateway and engine share every core, the engine runs one thread per core with
  OpenMP's own wait policy (spin, then sleep);
- after: the defaults (`[engine] cpus = "auto"`: the gateway keeps the first core, the engine
  gets the rest, one thread per core, passive waiting).

Per layout, phases of `--seconds` each: the engine alone (8 clients, each sending a new prompt as
soon as its last answer came, `--max-tokens` tokens, `Cache-Control: no-store` so that each reaches
the engine), then for each rate in `--rates`: the hits alone (an open-loop stream of that many
paraphrases of 40 stored questions per second: semantic hits), then both at once. Reported: engine
output tokens/s, hit latency p50/p99 and the hit rate achieved. Layouts are interleaved round by
round (each round restarts `cachegw serve`). Before and after differ only in
the layout (the decode step eager in both); "after, compiled" adds the default compiled decode step
(compiled before serving, so that no compile runs during the phases).

    .venv/bin/python -m bench.mixed_load [--rounds 1] [--seconds 15] [--rates 50,100] [--port 18460]
        [--layouts "after; after, cross-encoder always"]

"after, cross-encoder always" is the split layout with the semantic hit as it was before the MLP could
spare the cross-encoder (`[cache.verifier] skip_cross_from = 2.0`); "after, no model memo" the split
layout with every repeated paraphrase running its models again (`[cache] model_memo_entries = 0`), as a
paraphrase never seen before does.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.common import RESULTS, ROOT, pct, save, say
from bench.gateway_latency import QUESTIONS, body, paraphrase, start, stop, timed, wait_health

LAYOUTS = {
    "before": '[engine]\ncpus = "all"\nthreads = 0\nomp_wait_policy = "runtime"\ncompile = "off"\n',
    "after": '[engine]\ncompile = "off"\n',  # the core split and thread defaults
    "after, compiled": '[engine]\ncompile = "startup"\n',  # and the compiled decode step
    # the split layout with the semantic hit as it was: the cross-encoder asked about every candidate
    "after, cross-encoder always": '[engine]\ncompile = "off"\n[cache.verifier]\nskip_cross_from = 2.0\n',
    # the split layout with every repeat of a paraphrase running the models again (no model memo)
    "after, no model memo": '[engine]\ncompile = "off"\n[cache]\nmodel_memo_entries = 0\n',
}


async def engine_load(url: str, clients: int, seconds: float, max_tokens: int, salt: str) -> dict:
    """Closed loop: each client sends a new (never cached) prompt as soon as its answer came."""
    tokens, done = 0, 0
    stop = time.monotonic() + seconds
    counter = itertools.count()
    async with httpx.AsyncClient(timeout=300) as c:

        async def client() -> None:
            nonlocal tokens, done
            while time.monotonic() < stop:
                payload = body(f"Write a long story about {salt} ship number {next(counter)}", max_tokens)
                # no-store: the gateway neither answers from nor keeps these (RFC 9111), so every
                # one reaches the engine; similar stories would otherwise hit each other.
                headers = {"Authorization": "Bearer bench", "Cache-Control": "no-store"}
                r = await c.post(url, json=payload, headers=headers)
                r.raise_for_status()
                tokens += r.json()["usage"]["completion_tokens"]
                done += 1

        start_t = time.monotonic()
        await asyncio.gather(*(client() for _ in range(clients)))
        elapsed = time.monotonic() - start_t
    return {"tokens_per_s": round(tokens / elapsed, 1), "requests": done}


async def hit_stream(url: str, rate: float, seconds: float) -> dict:
    """Open loop: a paraphrase every 1/rate s whether or not earlier ones were answered."""
    latencies: list[float] = []
    kinds: dict[str, int] = {}
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=60, limits=limits) as c:

        async def one(q: str) -> None:
            ms, kind = await timed(c, url, body(paraphrase(q)))
            kinds[kind] = kinds.get(kind, 0) + 1
            if kind == "semantic-hit":
                latencies.append(ms)

        tasks = []
        start_t = time.monotonic()
        for i in range(int(rate * seconds)):
            await asyncio.sleep(max(0.0, start_t + i / rate - time.monotonic()))
            tasks.append(asyncio.create_task(one(QUESTIONS[i % len(QUESTIONS)])))
        await asyncio.gather(*tasks)
        elapsed = time.monotonic() - start_t
    return {
        "offered_per_s": rate,
        "answered_per_s": round(sum(kinds.values()) / elapsed, 1),
        "p50_ms": round(pct(latencies, 50), 1) if latencies else None,
        "p99_ms": round(pct(latencies, 99), 1) if latencies else None,
        "kinds": kinds,
    }


async def one_layout(name: str, args: argparse.Namespace, work: Path, salt: str) -> dict:
    port = args.port
    config = work / f"{name.replace(', ', '-')}.toml"
    config.write_text(LAYOUTS[name])
    data = work / f"data-{config.stem}-{salt}"
    cmd = [sys.executable, "-m", "cachegw.gateway.cli", "serve", "--port", str(port), "--config", str(config)]
    proc = start([*cmd, "--data-dir", str(data)], work / f"{config.stem}-{salt}.log")
    try:
        url = f"http://127.0.0.1:{port}"
        await wait_health(url, proc, timeout=600)  # a compile at start-up takes a minute or two
        chat = f"{url}/v1/chat/completions"
        async with httpx.AsyncClient(timeout=120) as c:
            for q in QUESTIONS:  # the stored answers the paraphrases will hit
                await timed(c, chat, body(q))
        say(f"{name}: engine alone")
        result: dict = {
            "engine_alone": await engine_load(chat, args.clients, args.seconds, args.max_tokens, salt)
        }
        for rate in args.rates:
            say(f"{name}: {rate:g} hits/s alone, then beside the engine")
            result[f"hits_alone@{rate:g}"] = await hit_stream(chat, rate, args.seconds)
            engine, hits = await asyncio.gather(
                engine_load(chat, args.clients, args.seconds, args.max_tokens, f"{salt}{rate:g}"),
                hit_stream(chat, rate, args.seconds),
            )
            result[f"engine_beside@{rate:g}"], result[f"hits_beside_engine@{rate:g}"] = engine, hits
    finally:
        stop(proc)
    say(f"{name}: {result}")
    return result


async def run(args: argparse.Namespace, work: Path) -> dict:
    rounds: list[dict[str, dict]] = []
    for r in range(args.rounds):
        order = args.layouts if r % 2 == 0 else args.layouts[::-1]
        rounds.append({name: await one_layout(name, args, work, f"r{r}") for name in order})
    return {"rounds": rounds}


def _median(runs: list[dict], phase: str, key: str) -> float | None:
    vals = sorted(v for run in runs if (v := run[phase][key]) is not None)
    return vals[len(vals) // 2] if vals else None


def summary(rounds: list[dict[str, dict]], rates: list[float]) -> dict[str, dict]:
    """Medians over the rounds, per layout."""
    out: dict[str, dict] = {}
    for name in rounds[0]:
        runs = [r[name] for r in rounds]
        row: dict[str, float | None] = {"engine_tok_s_alone": _median(runs, "engine_alone", "tokens_per_s")}
        for rate in rates:
            row[f"engine_tok_s_beside_{rate:g}_hits_s"] = _median(
                runs, f"engine_beside@{rate:g}", "tokens_per_s"
            )
            row[f"hit_p50_ms_alone@{rate:g}"] = _median(runs, f"hits_alone@{rate:g}", "p50_ms")
            row[f"hit_p50_ms_beside_engine@{rate:g}"] = _median(
                runs, f"hits_beside_engine@{rate:g}", "p50_ms"
            )
            row[f"hit_p99_ms_beside_engine@{rate:g}"] = _median(
                runs, f"hits_beside_engine@{rate:g}", "p99_ms"
            )
            row[f"hits_answered_per_s_beside_engine@{rate:g}"] = _median(
                runs, f"hits_beside_engine@{rate:g}", "answered_per_s"
            )
        out[name] = row
    return out


def plot(summary: dict[str, dict], rates: list[float], path: Path) -> None:
    """Engine tokens/s beside each hit rate, and hit p50 beside the engine, per layout."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.8 / len(summary)
    for i, (name, row) in enumerate(summary.items()):
        xs = [j + i * width for j in range(len(rates) + 1)]
        toks = [row["engine_tok_s_alone"]] + [row[f"engine_tok_s_beside_{r:g}_hits_s"] for r in rates]
        left.bar(xs, [t or 0 for t in toks], width, label=name)
        p50 = [row[f"hit_p50_ms_beside_engine@{r:g}"] or 0 for r in rates]
        right.bar(xs[: len(rates)], p50, width, label=name)
    left.set_xticks(
        [j + 0.4 - width / 2 for j in range(len(rates) + 1)],
        ["alone"] + [f"beside {r:g} hits/s" for r in rates],
    )
    left.set_ylabel("engine output tokens / s (8 clients)")
    right.set_xticks([j + 0.4 - width / 2 for j in range(len(rates))], [f"{r:g} hits/s" for r in rates])
    right.set_ylabel("semantic-hit p50 beside the engine (ms)")
    left.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    say(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--rates", default="50,100", help="semantic hits per second, each its own phases")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default="mixed_load", help="result name under bench/results/")
    ap.add_argument("--port", type=int, default=18460)
    ap.add_argument("--layouts", default="; ".join(list(LAYOUTS)[:3]), help=f"some of: {'; '.join(LAYOUTS)}")
    args = ap.parse_args()
    args.layouts = [name.strip() for name in args.layouts.split(";")]
    unknown = [n for n in args.layouts if n not in LAYOUTS]
    if unknown:
        ap.error(f"unknown layouts {unknown}")
    args.rates = [float(r) for r in args.rates.split(",")]
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="cachegw-mixed-") as tmp:
        result = asyncio.run(run(args, Path(tmp)))
    result["summary"] = summary(result["rounds"], args.rates)
    result["settings"] = vars(args) | {"layouts": LAYOUTS, "load_before": load}
    save(args.out, result)
    plot(result["summary"], args.rates, RESULTS / f"{args.out}.png")
    for name, s in result["summary"].items():
        print(name, s)


if __name__ == "__main__":
    os.chdir(ROOT)
    main()
