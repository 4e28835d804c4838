"""`LLM()` in a plain script, alone and beside one busy process: its threads settled as `cachegw
backend` settles them (the default now) against torch's defaults (torch imported first, so OpenMP's
threads spin while they wait, as they did before `LLM()` settled them).

Each variant is a script in its own process, loaded once; rounds are interleaved (each variant alone,
then each beside a process spinning on one core). A run: a 200-token prompt, then ``--new`` greedy
tokens with EOS ignored; decode tokens/s is the tokens after the first over the time after it.

    .venv/bin/python -m bench.script_contention [--runs 3] [--new 64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from bench.common import ROOT, save, say

_SCRIPT = """
import json, sys, time
if sys.argv[1] == "torch first":
    import torch  # OpenMP reads its environment now: the engine's settling comes too late
from cachegw.backend import LLM, SamplingParams
llm = LLM(kv_cache_tokens=1024, max_num_seqs=1, enable_prefix_caching=False)
prompt = list(range(1000, 1200))
params = SamplingParams(temperature=0.0, max_tokens=int(sys.argv[2]), ignore_eos=True)
print("ready", flush=True)
for _ in sys.stdin:
    engine, start, first = llm.engine, time.perf_counter(), 0.0
    engine.add_request(f"r{start}", prompt, params)
    while engine.requests:
        if engine.step() and not first:
            first = time.perf_counter()
    end = time.perf_counter()
    print(json.dumps((int(sys.argv[2]) - 1) / (end - first)), flush=True)
"""
VARIANTS = ("LLM() now", "torch first")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--new", type=int, default=64)
    args = ap.parse_args()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    workers = {}
    for v in VARIANTS:
        cmd = [sys.executable, "-c", _SCRIPT, v, str(args.new)]
        workers[v] = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        out = workers[v].stdout
        assert out is not None and out.readline().strip() == "ready"
        say(f"{v} loaded")
    runs: dict[str, list[float]] = {f"{v} {c}": [] for v in VARIANTS for c in ("alone", "busy")}
    load = [os.getloadavg()[0]]
    try:
        for r in range(args.runs):
            for condition in ("alone", "busy"):
                spinner = None
                if condition == "busy":
                    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
                try:
                    for v, proc in workers.items():
                        assert proc.stdin is not None and proc.stdout is not None
                        proc.stdin.write("go\n")
                        proc.stdin.flush()
                        runs[f"{v} {condition}"].append(round(json.loads(proc.stdout.readline()), 1))
                        say(f"round {r + 1} {condition:5} {v:12} decode {runs[f'{v} {condition}'][-1]} tok/s")
                finally:
                    if spinner is not None:
                        spinner.kill()
                        spinner.wait()
                load.append(os.getloadavg()[0])
    finally:
        for proc in workers.values():
            proc.kill()
            proc.wait()
    median = {k: statistics.median(v) for k, v in runs.items()}
    share = {v: round(median[f"{v} busy"] / median[f"{v} alone"], 2) for v in VARIANTS}
    say(f"median decode tok/s {median}; busy/alone {share}")
    save(
        "script_contention",
        {
            "what": "LLM() in a script, batch-1 decode tok/s (200-token prompt, EOS ignored), alone and "
            "beside one process spinning on a core; compile off in both",
            "new_tokens": args.new,
            "cores": len(os.sched_getaffinity(0)),
            "load_average_1min": load,
            "runs": runs,
            "median_tok_s": median,
            "busy_share": share,
        },
    )


if __name__ == "__main__":
    main()
