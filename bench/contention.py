"""The engine beside other work on the same cores: batch-1 prefill and decode, alone and beside one
busy process, for each thread count, OpenMP wait policy and pinning; llama.cpp on the same GGUF beside
the same load as the peer.

Each configuration is its own worker process (OpenMP reads its environment once, at start) and
stays loaded; the rounds are interleaved (every worker runs alone, then every worker runs beside a
process spinning on one core), so drift in the machine's load hits every configuration alike. The
busy process is a plain `while True: pass` that the kernel may place on any core, as another tenant
of a VM would be. A run: a 200-token prompt, then `--new` greedy tokens with EOS ignored.

    .venv/bin/python -m bench.contention [--runs 3] [--new 128] [--mode auto] [--threads 1,2]
        [--spins 1000,30000]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
from dataclasses import dataclass

from bench.common import RESULTS, save, say
from bench.peers import Peer


@dataclass(frozen=True)
class Setup:
    """One way to run an engine: its threads, OpenMP wait policy ("" = the runtime's default), how
    long an idle thread spins before it sleeps (`GOMP_SPINCOUNT`, "" = the default: 300,000 spins,
    or none with a passive policy; torch's wheels use GNU OpenMP), and whether its threads are bound
    to cores (`OMP_PROC_BIND`; one thread: to the last core)."""

    engine: str  # "ours" | "llama.cpp"
    threads: int
    wait: str = ""
    pinned: bool = False
    spin: str = ""

    @property
    def name(self) -> str:
        parts = [self.engine, f"{self.threads}t"]
        parts += [f"wait={self.wait.lower()}"] if self.wait else []
        parts += ["pinned"] if self.pinned else []
        parts += [f"spin={self.spin}"] if self.spin else []
        return " ".join(parts)

    def env(self) -> dict[str, str]:
        env = {"OMP_WAIT_POLICY": self.wait} if self.wait else {}
        env |= {"GOMP_SPINCOUNT": self.spin} if self.spin else {}
        if self.pinned:
            env |= {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"}
        return env


def setups(threads: list[int], with_peer: bool, spins: list[str]) -> list[Setup]:
    out = []
    for t in threads:
        for wait in ("", "PASSIVE"):
            for pinned in (False, True):
                out.append(Setup("ours", t, wait, pinned))
        out += [Setup("ours", t, spin=spin) for spin in spins if t > 1]
        if with_peer:
            out.append(Setup("llama.cpp", t))
    return out


def start(setup: Setup, mode: str, gguf: str) -> Peer:
    cores = sorted(os.sched_getaffinity(0))
    cpus = cores[-setup.threads :] if setup.pinned else None
    options: dict = (
        dict(quantization=mode, kv_cache_tokens=1024, max_num_seqs=1, enable_prefix_caching=False)
        if setup.engine == "ours"
        else dict(path=gguf)
    )
    kind = "ours" if setup.engine == "ours" else "llama.cpp"
    return Peer(setup.name, kind, env=setup.env(), cpus=cpus, threads=setup.threads, **options)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=200)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--mode", default="auto", help="our engine's [engine] quantization")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--spins", default="", help="GOMP_SPINCOUNT values to add for several threads")
    ap.add_argument("--out", default="contention")
    args = ap.parse_args()
    from cachegw.backend.executor.model_loader import embedded_gguf_path

    gguf = str(embedded_gguf_path())
    try:
        import llama_cpp  # noqa: F401

        with_peer = True
    except ImportError:
        say("llama-cpp-python is not installed: skipping the llama.cpp peer")
        with_peer = False
    rng = random.Random(0)
    prompt = [rng.randrange(100, 49152) for _ in range(args.prompt)]
    workers = {}
    spins = [v for v in args.spins.split(",") if v]
    for s in setups([int(t) for t in args.threads.split(",")], with_peer, spins):
        workers[s] = start(s, args.mode, gguf)
        say(f"{s.name} loaded")
    runs: dict[tuple[str, str], list] = {(s.name, c): [] for s in workers for c in ("alone", "busy")}
    load = [os.getloadavg()[0]]
    for r in range(args.runs):
        for condition in ("alone", "busy"):
            spinner = None
            if condition == "busy":
                spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            try:
                for s, peer in workers.items():
                    runs[(s.name, condition)].append(peer.single(prompt, args.new))
                    speed = runs[(s.name, condition)][-1]
                    say(f"round {r + 1} {condition:5} {s.name:28} decode {speed.decode:6.1f} tok/s")
            finally:
                if spinner is not None:
                    spinner.kill()
                    spinner.wait()
            load.append(os.getloadavg()[0])
    for peer in workers.values():
        peer.stop()
    result = {}
    for s in workers:
        row = {}
        for c in ("alone", "busy"):
            row[c] = {
                "prefill_tok_per_s": round(statistics.median(x.prefill for x in runs[(s.name, c)]), 1),
                "decode_tok_per_s": round(statistics.median(x.decode for x in runs[(s.name, c)]), 1),
                "decode_runs": [round(x.decode, 1) for x in runs[(s.name, c)]],
            }
        for phase in ("decode", "prefill"):
            share = row["busy"][f"{phase}_tok_per_s"] / row["alone"][f"{phase}_tok_per_s"]
            row[f"{phase}_busy_share"] = round(share, 2)
        result[s.name] = row
    save(
        args.out,
        {
            "mode": args.mode,
            "prompt_tokens": args.prompt,
            "new_tokens": args.new,
            "cores": len(os.sched_getaffinity(0)),
            "load_average_1min": load,
            "setups": result,
        },
    )
    plot(result, RESULTS / f"{args.out}.png")


def plot(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result)
    fig, ax = plt.subplots(figsize=(9, 4))
    x = range(len(names))
    for shift, condition, label in ((-0.2, "alone", "alone"), (0.2, "busy", "beside one busy core")):
        heights = [result[n][condition]["decode_tok_per_s"] for n in names]
        ax.bar([i + shift for i in x], heights, 0.4, label=label)
    ax.set_xticks(list(x), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("batch-1 decode tokens / s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    say(f"wrote {path}")


if __name__ == "__main__":
    main()
