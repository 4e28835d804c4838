"""Time to first token of one prompt alone, at 200 / 1,000 / 2,000 tokens: our engine (int4 from the
GGUF, `auto`, and float32, `none`) against llama.cpp on the same Q4_1 file and HF transformers float32.

No prefix cache (every prompt is computed whole) and one request at a time: the time of the prefill
plus the first token's sampling. Each engine is a worker process of its own (`bench/peers.py`),
loaded once; the runs are interleaved (every engine at every length in a round), after one warm-up
round at the shortest length that is not counted.

    .venv/bin/python -m bench.ttft [--lengths 200,1000,2000] [--runs 3] [--threads 2]
        [--modes auto,none,auto+avx2] [--llama avx2=/work/llama-peer-avx2,native=/work/llama-peer]
        [--baseline before=/tmp/old-checkout]

A mode is ``[engine] quantization``, with ``+avx512``/``+avxvnni``/``+avx2``/``+torch`` for
``[engine] cpu_kernels`` (the best build of cachegw's otherwise); ``--llama``: llama-cpp-python
builds, each a folder on its own worker's PYTHONPATH (default: the installed package); ratios are
to each of them. ``--baseline``: another checkout of cachegw (its folder first on its own workers'
PYTHONPATH), every mode run on it too, in the same interleaved rounds.
"""

from __future__ import annotations

import argparse
import random
import statistics

from bench.common import RESULTS, save, say
from bench.peers import Peer, llamacpp_builds, load_average, torch_env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="200,1000,2000")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--modes", default="auto,none", help="our engine's [engine] quantization, each")
    ap.add_argument("--out", default="ttft")
    ap.add_argument("--llama", default="", help="name=folder,... of llama-cpp-python builds")
    ap.add_argument("--no-hf", action="store_true", help="leave out the HF transformers peer")
    ap.add_argument("--baseline", default="", help="name=folder of another cachegw checkout")
    args = ap.parse_args()
    from cachegw.backend.executor.model_loader import embedded_gguf_path

    lengths = [int(n) for n in args.lengths.split(",")]
    rng = random.Random(0)
    prompts = {n: [rng.randrange(100, 49152) for _ in range(n)] for n in lengths}
    room = max(lengths) + 64
    specs: list[tuple[str, str, dict, dict[str, str]]] = []
    for mode in args.modes.split(","):
        weights, *flags = mode.split("+")
        kernels = flags[0] if flags else "auto"
        options = dict(quantization=weights, cpu_kernels=kernels, kv_cache_tokens=room, max_num_seqs=1)
        specs.append((f"ours {mode}", "ours", dict(enable_prefix_caching=False, **options), {}))
        if args.baseline:
            label, _, folder = args.baseline.partition("=")
            specs.append(
                (
                    f"ours {mode} ({label})",
                    "ours",
                    dict(enable_prefix_caching=False, **options),
                    {"PYTHONPATH": folder},
                )
            )
    llamas = llamacpp_builds(args.llama)
    if not llamas:
        say("no llama-cpp-python build: skipping the llama.cpp peer")
    gguf = str(embedded_gguf_path())
    specs += [(name, "llama.cpp", dict(path=gguf, n_ctx=room), env) for name, env in llamas]
    if not args.no_hf:
        specs.append(("HF transformers float32", "hf", {}, {}))
    peers = {}
    for name, kind, options, env in specs:
        env = {**env, **(torch_env(args.threads) if kind != "llama.cpp" else {})}
        peers[name] = Peer(name, kind, env=env, threads=args.threads, **options)
        say(f"{name} loaded")
    for peer in peers.values():  # warm-up: first-call costs (kernel selection, allocations)
        peer.single(prompts[lengths[0]], 1)
    load = [load_average()]
    runs: dict[str, dict[int, list[float]]] = {name: {n: [] for n in lengths} for name in peers}
    for r in range(args.runs):
        for n in lengths:
            for name, peer in peers.items():
                ms = peer.single(prompts[n], 1).ttft * 1000
                runs[name][n].append(round(ms, 1))
                say(f"round {r + 1} {n:5} tokens {name:24} TTFT {ms:8.1f} ms")
            load.append(load_average())
    rss = {name: peer.stop() for name, peer in peers.items()}
    refs = {name: {n: statistics.median(runs[name][n]) for n in lengths} for name, _ in llamas}
    engines = {}
    for name in peers:
        medians = {n: statistics.median(runs[name][n]) for n in lengths}
        engines[name] = {
            "ttft_ms": {str(n): runs[name][n] for n in lengths},
            "median_ms": {str(n): medians[n] for n in lengths},
            "ratio_to": {
                ref: {str(n): round(medians[n] / v[n], 2) for n in lengths} for ref, v in refs.items()
            },
            "peak_rss_mib": rss[name],
        }
    save(
        args.out,
        {
            "gguf": embedded_gguf_path().name,
            "lengths": lengths,
            "runs": args.runs,
            "threads": args.threads,
            "prefix_caching": False,
            "load_average_1min": load,
            "engines": engines,
        },
    )
    plot(engines, lengths, RESULTS / f"{args.out}.png", load, args.threads)


def plot(engines: dict, lengths: list[int], path, load: list[float], threads: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(engines)
    colors = {
        "ours auto": "#2a7",
        "ours none": "#8bc",
        "llama.cpp Q4_1": "#999",
        "HF transformers float32": "#c84",
    }
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    for i, name in enumerate(names):
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(lengths))]
        ax.bar(
            xs,
            [engines[name]["median_ms"][str(n)] for n in lengths],
            width,
            label=name,
            color=colors.get(name),
        )
        for x, n in zip(xs, lengths, strict=True):
            ax.plot([x] * len(engines[name]["ttft_ms"][str(n)]), engines[name]["ttft_ms"][str(n)], "k.", ms=3)
    ax.set_xticks(range(len(lengths)), [f"{n:,} tokens" for n in lengths])
    ax.set_ylabel("time to first token, ms (median of runs)")
    ax.set_title(f"TTFT, one request, SmolLM2-135M, {threads} threads, load {min(load):.1f}-{max(load):.1f}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    say(f"wrote {path}")


if __name__ == "__main__":
    main()
