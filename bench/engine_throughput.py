"""Output tokens/s under many concurrent requests: our engine against HF `generate` in static batches
and llama.cpp serving one request at a time.

A workload of N requests (N = each `--concurrency`, all submitted at once): prompt lengths 64-512 and
output lengths 16-256 drawn with a seed (`ignore_eos`), SmolLM2-135M; a smaller N is the first N
requests of the largest. Ours: continuous batching of all N, in the default weight mode (`auto`: the
GGUF's int4) with the compiled decode step (`+compile`, compiled before the runs, as a server runs
once its background compile is done; a mode without it runs eagerly), run at each N. HF: float32
`generate` in static batches of 16 (left-padded); a batch
lasts as long as its longest output, and only each request's own output tokens count as useful (as a
client would see them). llama.cpp (llama-cpp-python 0.3.36 on the same Q4_1 GGUF): its server has no
parallel slots (every request takes one global lock), so it serves one request after another. Neither
peer's rate depends on N (HF works through batches of 16 one after another, llama.cpp through single
requests), so each runs once, on the first `--hf-requests` / `--llamacpp-requests` requests (0: all),
between our runs, to keep the run within minutes. Each engine is a worker process of its own
(`bench/peers.py`), whose peak RSS is reported.

    .venv/bin/python -m bench.engine_throughput [--concurrency 32,64] [--modes auto+compile] [--threads 2]
        [--peers hf,llama.cpp] [--hf-requests 32] [--llamacpp-requests 16] [--llamacpp-threads N]
        [--out engine_throughput]
"""

from __future__ import annotations

import argparse
import random

from bench.common import save, say
from bench.peers import Peer, Work, llamacpp_installed, load_average, torch_env

PROMPT_LEN, OUTPUT_LEN = (64, 512), (16, 256)
VOCAB = 49152  # SmolLM2's; prompt ids are drawn from 100 up


def workload(n: int, seed: int, vocab: int) -> Work:
    rng = random.Random(seed)
    return [
        ([rng.randrange(100, vocab) for _ in range(rng.randint(*PROMPT_LEN))], rng.randint(*OUTPUT_LEN))
        for _ in range(n)
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="32,64", help="requests in flight at once, e.g. 32,64")
    ap.add_argument(
        "--modes",
        default="auto+compile",
        help="our engine's [engine] quantization, each (auto,none); +compile: the compiled decode step",
    )
    ap.add_argument("--peers", default="hf,llama.cpp", help="the peers to run ('' for none)")
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--hf-requests", type=int, default=32, help="0: the whole workload")
    ap.add_argument("--llamacpp-requests", type=int, default=16, help="0: the whole workload")
    ap.add_argument("--threads", type=int, default=2)
    # llama.cpp's threads spin at their barriers: beside other busy processes 1 thread is its best
    ap.add_argument("--llamacpp-threads", type=int, default=0, help="0: --threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="engine_throughput")
    args = ap.parse_args()
    from cachegw.backend.executor.model_loader import embedded_gguf_path

    sizes = [int(c) for c in args.concurrency.split(",")]
    env = torch_env(args.threads)
    ours_names = [f"ours {m}" for m in args.modes.split(",")]
    peers = {}
    for mode in args.modes.split(","):  # "auto+compile": the compiled decode step, compiled first
        weights, *flags = mode.split("+")
        compile_ = "startup" if "compile" in flags else "off"
        peers[f"ours {mode}"] = Peer(
            "ours",
            "ours",
            env,
            threads=args.threads,
            quantization=weights,
            compile=compile_,
            max_num_seqs=max(sizes),
        )
    wanted = [p for p in args.peers.split(",") if p]
    if "hf" in wanted:
        peers["HF float32"] = Peer("hf", "hf", env, threads=args.threads, static_batch=args.hf_batch)
    if "llama.cpp" in wanted and llamacpp_installed():
        peers["llama.cpp Q4_1"] = Peer(
            "llama.cpp",
            "llama.cpp",
            threads=args.llamacpp_threads or args.threads,
            path=str(embedded_gguf_path()),
        )
    elif "llama.cpp" in wanted:
        say("llama-cpp-python is not installed: skipping the llama.cpp peer")
    say("engines loaded")
    full = workload(max(sizes), args.seed, VOCAB)  # each smaller workload is its first N requests
    served: dict[str, dict] = {}
    # ours at each concurrency, the peers once in between (interleaved against load drift)
    order = [(name, sizes[0]) for name in ours_names] + [
        (name, 0) for name in peers if name not in ours_names
    ]
    order += [(name, n) for n in sizes[1:] for name in ours_names]
    for name, n in order:
        subset = {"HF float32": args.hf_requests, "llama.cpp Q4_1": args.llamacpp_requests}.get(name, n)
        part = full[: subset or len(full)]
        before = load_average()
        seconds = peers[name].batch(part)
        useful = sum(m for _, m in part)
        key = f"{name} @{n}" if name in ours_names else name
        served[key] = {
            "requests": len(part),
            "prompt_tokens": sum(len(p) for p, _ in part),
            "output_tokens": useful,
            "seconds": round(seconds, 2),
            "output_tok_per_s": round(useful / seconds, 1),
            "load_average_1min": [before, load_average()],
        }
        say(f"{key}: {len(part)} requests served in {seconds:.1f} s, {useful / seconds:.1f} output tok/s")
    runs = {}
    for n in sizes:
        ours = {name: served[f"{name} @{n}"] for name in ours_names}
        others = {k: v for k, v in served.items() if not k.startswith("ours")}
        runs[str(n)] = {
            "requests": n,
            "engines": ours | others,
            "ours_vs": {  # the first mode against each peer
                k: round(ours[ours_names[0]]["output_tok_per_s"] / v["output_tok_per_s"], 2)
                for k, v in others.items()
            },
            "ratios": {
                f"{a} / {b}": round(ra["output_tok_per_s"] / rb["output_tok_per_s"], 2)
                for a, ra in ours.items()
                for b, rb in (others | ours).items()
                if a != b
            },
        }
    rss = {name: peer.stop() for name, peer in peers.items()}
    save(
        args.out,
        {
            "workload": {
                "prompt_len": list(PROMPT_LEN),
                "output_len": list(OUTPUT_LEN),
                "seed": args.seed,
                "ignore_eos": True,
                "hf_static_batch": args.hf_batch,
                "hf_requests": args.hf_requests,
                "llamacpp": "one request at a time (no parallel slots in llama-cpp-python's server)",
                "llamacpp_requests": args.llamacpp_requests,
            },
            "threads": args.threads,
            "llamacpp_threads": args.llamacpp_threads or args.threads,
            "mode": args.modes.split(",")[0],
            "modes": args.modes.split(","),
            "runs": runs,
            "peak_rss_mib": rss,
            "target": "ours >= 3x HF static batches",
        },
    )
    for n, row in runs.items():
        print(f"{n} requests: " + ", ".join(f"{k} {v}x" for k, v in row["ratios"].items()))


if __name__ == "__main__":
    main()
