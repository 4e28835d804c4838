"""Batch-1 decode tok/s: our engine in each weight mode against llama.cpp on the same GGUF file.

Each engine lives in its own worker process (so its peak RSS is its own) and the runs are
interleaved round by round, so machine load hits every engine alike. A run: a 200-token prompt,
then 256 greedy tokens with EOS ignored; decode tok/s counts the tokens after the first over the
time after the first. llama.cpp (llama-cpp-python, a bench peer only, not a dependency) is skipped
with a message when it is not installed.

    .venv/bin/python -m bench.decode_vs_llamacpp [--runs 3] [--new 256] [--modes none,int8,int4,auto]
        [--threads 2]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import resource
import statistics
import time
from multiprocessing.connection import Connection
from typing import NamedTuple

from bench.common import RESULTS, save, say


class Speed(NamedTuple):
    """One run: the prompt's tokens per second of prefill (to the first token), then decode's."""

    prefill: float
    decode: float


def _ours(mode: str, prompt: list[int], new: int, threads: int, conn: Connection) -> None:
    import torch

    torch.set_num_threads(threads)
    from backend import LLM, SamplingParams

    llm = LLM(
        quantization=mode, dtype="float32", kv_cache_tokens=1024, max_num_seqs=1, enable_prefix_caching=False
    )
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    n = 0
    conn.send("ready")
    while conn.recv() == "run":
        n += 1
        start = time.perf_counter()
        engine.add_request(f"r{n}", prompt, params)
        first = 0.0
        done = False
        while not done:
            outs = engine.step()
            if not first and outs:
                first = time.perf_counter()
            done = any(o.finished for o in outs)
        conn.send(Speed(len(prompt) / (first - start), (new - 1) / (time.perf_counter() - first)))
    conn.send(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def _llamacpp(path: str, prompt: list[int], new: int, threads: int, conn: Connection) -> None:
    from llama_cpp import Llama

    llm = Llama(
        model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=1024, n_batch=512, verbose=False
    )
    conn.send("ready")
    while conn.recv() == "run":
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        token = llm.sample(temp=0.0)
        first = time.perf_counter()
        for _ in range(new - 1):
            llm.eval([token])
            token = llm.sample(temp=0.0)
        conn.send(Speed(len(prompt) / (first - start), (new - 1) / (time.perf_counter() - first)))
    conn.send(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=200)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--modes", default="none,int8,int4,auto")
    # 2 on a quiet machine; on a loaded one 2 OpenMP threads per engine collapse (spinning barriers)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="decode_vs_llamacpp")
    args = ap.parse_args()
    from backend.model_loader import embedded_gguf_path

    gguf = embedded_gguf_path()
    rng = random.Random(0)
    prompt = [rng.randrange(100, 49152) for _ in range(args.prompt)]
    ctx = mp.get_context("spawn")
    workers: dict[str, tuple[mp.process.BaseProcess, Connection]] = {}
    peers = [(f"ours {m}", _ours, m) for m in args.modes.split(",")]
    try:
        import llama_cpp  # noqa: F401

        peers.append(("llama.cpp", _llamacpp, str(gguf)))
    except ImportError:
        say("llama-cpp-python is not installed: skipping the llama.cpp peer (docs/benchmarks.md says how)")
    for name, fn, arg in peers:  # loaded one after another: loading is not what is measured
        here, there = ctx.Pipe()
        proc = ctx.Process(target=fn, args=(arg, prompt, args.new, args.threads, there), daemon=True)
        proc.start()
        assert here.recv() == "ready"
        workers[name] = (proc, here)
        say(f"{name} loaded")
    load = [os.getloadavg()[0]]
    runs: dict[str, list[float]] = {name: [] for name in workers}
    for r in range(args.runs):
        for name, (_, conn) in workers.items():
            conn.send("run")
            runs[name].append(round(conn.recv().decode, 1))
            say(f"round {r + 1} {name}: {runs[name][-1]} tok/s")
        load.append(os.getloadavg()[0])
    rss = {}
    for name, (proc, conn) in workers.items():
        conn.send("stop")
        rss[name] = round(conn.recv())
        proc.join(10)
    ref = statistics.median(runs["llama.cpp"]) if "llama.cpp" in runs else None
    result = {
        name: {
            "decode_tok_per_s": runs[name],
            "median": statistics.median(runs[name]),
            "ratio_to_llamacpp": None if ref is None else round(statistics.median(runs[name]) / ref, 2),
            "peak_rss_mib": rss[name],
        }
        for name in workers
    }
    save(
        args.out,
        {
            "gguf": gguf.name,
            "prompt_tokens": args.prompt,
            "new_tokens": args.new,
            "threads": args.threads,
            "load_average_1min": load,
            "engines": result,
        },
    )
    plot(result, RESULTS / f"{args.out}.png", load, args.threads)


def plot(result: dict, path, load: list[float], threads: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result)
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.bar(
        names,
        [result[n]["median"] for n in names],
        color=["#2a7" if n.startswith("ours") else "#999" for n in names],
    )
    for i, n in enumerate(names):
        ax.plot([i] * len(result[n]["decode_tok_per_s"]), result[n]["decode_tok_per_s"], "k.")
    ax.set_ylabel("decode tokens / s (batch 1)")
    ax.set_title(f"SmolLM2-135M Q4_1, {threads} thread(s), load avg {min(load):.0f}-{max(load):.0f}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    say(f"wrote {path}")


if __name__ == "__main__":
    main()
