"""Batch-1 decode tok/s: our engine in each weight mode against llama.cpp on the same GGUF file.

Each engine lives in its own worker process (`bench/peers.py`: so its peak RSS is its own) and the
runs are interleaved round by round, so machine load hits every engine alike. A run: a 200-token prompt,
then 256 greedy tokens with EOS ignored; decode tok/s counts the tokens after the first over the
time after the first. llama.cpp (llama-cpp-python, a bench peer only, not a dependency) is skipped
with a message when it is not installed.

    .venv/bin/python -m bench.decode_vs_llamacpp [--runs 3] [--new 256]
        [--modes none,int8,int4,auto,auto+compile] [--threads 2]
        [--llama avx2=/work/llama-peer-avx2,native=/work/llama-peer] [--baseline before=/tmp/old-checkout]

Without flags a mode runs as the server does: decode-only steps fused into one call into cachegw's
kernels where they can (`[engine] fused_decode`), else the eager modules. ``+eager`` turns the fused step
off (the eager modules); ``+compile`` runs the compiled decode step instead (`[engine] compile`, compiled
before the runs, the fused step off). ``+torch`` runs torch's int4/int8 kernels (`[engine] cpu_kernels =
"torch"`) instead of cachegw's; ``+avx512``, ``+avxvnni``, ``+avx2`` one build of cachegw's (the
best this CPU has otherwise). ``--llama``: llama-cpp-python builds to compare with, each a folder
put on its own worker's PYTHONPATH (default: the installed package, if any); every engine's ratio
to each of them is reported. ``--baseline``: another checkout of cachegw (its folder put first on
its own workers' PYTHONPATH), every mode run on it too, so a change is measured against the code
before it in the same interleaved run.
"""

from __future__ import annotations

import argparse
import random
import statistics

from bench.common import RESULTS, save, say
from bench.peers import Peer, llamacpp_builds, load_average


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=200)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--modes", default="none,int8,int4,auto,auto+compile")
    # 2 on a quiet machine; on a loaded one 2 OpenMP threads per engine collapse (spinning barriers)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="decode_vs_llamacpp")
    ap.add_argument("--llama", default="", help="name=folder,... of llama-cpp-python builds")
    ap.add_argument("--baseline", default="", help="name=folder of another cachegw checkout")
    args = ap.parse_args()
    from cachegw.backend.executor.layers.cpu_kernels import SETTINGS
    from cachegw.backend.executor.model_loader import embedded_gguf_path

    gguf = embedded_gguf_path()
    rng = random.Random(0)
    prompt = [rng.randrange(100, 49152) for _ in range(args.prompt)]
    ours = dict(kv_cache_tokens=1024, max_num_seqs=1, enable_prefix_caching=False)
    peers: list[tuple[str, str, dict, dict[str, str]]] = []
    for mode in args.modes.split(","):  # "auto+compile": the weight mode, decode step compiled first
        weights, *flags = mode.split("+")
        compile_ = "startup" if "compile" in flags else "off"
        fused = not ({"eager", "compile"} & set(flags))
        kernels = next((f for f in flags if f in SETTINGS), "auto")
        options = dict(
            quantization=weights, compile=compile_, cpu_kernels=kernels, fused_decode=fused, **ours
        )
        peers.append((f"ours {mode}", "ours", options, {}))
        if args.baseline:
            label, _, folder = args.baseline.partition("=")
            peers.append((f"ours {mode} ({label})", "ours", options, {"PYTHONPATH": folder}))
    llamas = llamacpp_builds(args.llama)
    if not llamas:
        say("no llama-cpp-python build: skipping the llama.cpp peer (docs/benchmarks.md says how)")
    peers += [(name, "llama.cpp", dict(path=str(gguf)), env) for name, env in llamas]
    workers: dict[str, Peer] = {}
    for name, kind, options, env in peers:  # loaded one after another: loading is not measured
        workers[name] = Peer(name, kind, env=env, threads=args.threads, **options)
        say(f"{name} loaded")
    load = [load_average()]
    runs: dict[str, list[float]] = {name: [] for name in workers}
    for r in range(args.runs):
        for name, peer in workers.items():
            runs[name].append(round(peer.single(prompt, args.new).decode, 1))
            say(f"round {r + 1} {name}: {runs[name][-1]} tok/s")
        load.append(load_average())
    rss = {name: peer.stop() for name, peer in workers.items()}
    bases = [name for name, *_ in peers if name.endswith(")") and name.startswith("ours")]
    refs = {name: statistics.median(runs[name]) for name in [n for n, _ in llamas] + bases}
    result = {
        name: {
            "decode_tok_per_s": runs[name],
            "median": statistics.median(runs[name]),
            "ratio_to": {ref: round(statistics.median(runs[name]) / v, 2) for ref, v in refs.items()},
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
    ax.tick_params(axis="x", labelsize=7, labelrotation=20)
    for i, n in enumerate(names):
        ax.plot([i] * len(result[n]["decode_tok_per_s"]), result[n]["decode_tok_per_s"], "k.")
    ax.set_ylabel("decode tokens / s (batch 1)")
    ax.set_title(f"SmolLM2-135M Q4_1, {threads} thread(s), load avg {min(load):.0f}-{max(load):.0f}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    say(f"wrote {path}")


if __name__ == "__main__":
    main()
