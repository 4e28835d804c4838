"""Seconds from launch to first token and to full-speed decode: `cachegw backend` on a new machine
(first start) and again (warm start), beside llama.cpp's load time on the same GGUF.

A first start runs with HOME in an empty temporary folder, so ~/.cache/cachegw (the model's config
and tokenizer, cachegw's CPU kernels, Inductor's compile cache) starts empty; the warm start reuses
that folder, or ``--prepared-home``, a HOME that `make prepare` (``python -m
cachegw.backend.entrypoints.prepare``) filled: what a first start after `make prepare` is.

Each start: launch the command, poll until it serves, ask for one token (the first token), then
decode 32 greedy tokens every few seconds (EOS ignored) and record each probe's tokens/s until
``--budget`` seconds have passed. Full speed is reached at the first probe within 10%
of the best probe of either start (the compiled step's speed). llama.cpp (llama-cpp-python in a
process of its own, ``--llama-path`` on its PYTHONPATH only) is timed from launch to its model
loaded and to the first token of the same prompt.

    .venv/bin/python -m bench.engine_startup [--budget 420] [--warm-budget 150] [--llama-path DIR]
        [--prepared-home DIR]

``--before DIR`` compares two builds instead: first starts of the source tree in DIR (an earlier
commit, e.g. from `git archive`) and of this one, interleaved ``--rounds`` times, each in an empty
HOME and TMPDIR (no model folder, no CPU kernels, no Inductor or precompiled-header cache), and each
build's CPU kernels built once more on their own into an empty folder (g++'s wall and CPU seconds).
Full speed is then each build's own steady state: the first probe within 10% of the best probe that
build reached in any of its starts.

    .venv/bin/python -m bench.engine_startup --before /tmp/base --rounds 1 --budget 90 --before-budget 180
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.common import ROOT, save, say
from bench.engine_memory import _stop
from testkit.servers import free_port

_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
_PROBE_TOKENS = 32
_LLAMA = """
import sys, time
start = float(sys.argv[3])
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=2048, n_threads=2, verbose=False)
loaded = time.time()
llm.create_completion(sys.argv[2], max_tokens=1, temperature=0.0)
print(loaded - start, time.time() - start, flush=True)
"""
_CLEARED = ("CACHEGW_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "CACHEGW_KERNEL_CACHE")


def _probe(url: str, model: str, tokens: int) -> float:
    """Seconds for a greedy completion of ``tokens`` tokens (EOS ignored)."""
    body = {"model": model, "prompt": _PROMPT, "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
    start = time.perf_counter()
    httpx.post(f"{url}/completions", json=body, timeout=600).raise_for_status()
    return time.perf_counter() - start


def _compiled_steps(url: str) -> int:
    """The server's count of decode steps the compiled step ran (0 while it compiles)."""
    text = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=30).text
    line = next((x for x in text.splitlines() if x.startswith("cachegw:compiled_decode_steps_total")), "")
    return int(float(line.split()[-1])) if line else 0


def ours(home: Path, budget: float, every: float, tree: Path = ROOT, fresh_tmp: bool = False) -> dict:
    """One start of `cachegw backend` (the source tree ``tree``) with HOME=home: its milestones and
    decode probes. ``fresh_tmp``: TMPDIR in an empty folder too (torch keeps some caches there)."""
    env = {k: v for k, v in os.environ.items() if k not in _CLEARED} | {"HOME": str(home)}
    if fresh_tmp:
        (home / "tmp").mkdir(exist_ok=True)
        env["TMPDIR"] = str(home / "tmp")
    port = free_port()
    cmd = [sys.executable, "-m", "cachegw.gateway.cli", "backend", "--port", str(port)]
    log = (home / f"backend-{time.time():.0f}.log").open("w")
    launch = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"cachegw backend exited with {proc.returncode} (log: {log.name})")
            try:
                model = httpx.get(f"{url}/models", timeout=2).json()["data"][0]["id"]
                break
            except (httpx.HTTPError, KeyError, ValueError):
                time.sleep(0.2)
        ready = time.monotonic() - launch
        one = _probe(url, model, 1)
        first_token = time.monotonic() - launch
        # (seconds since launch, tok/s, compiled, the machine's 1-minute load average)
        probes: list[tuple[float, float, bool, float]] = []
        while time.monotonic() - launch < budget:
            seconds = _probe(url, model, _PROBE_TOKENS + 1) - _probe(url, model, 1)
            speed = round(_PROBE_TOKENS / max(seconds, 1e-6), 1)
            compiled = _compiled_steps(url) > 0
            probes.append(
                (round(time.monotonic() - launch, 1), speed, compiled, round(os.getloadavg()[0], 1))
            )
            say(f"  {probes[-1][0]:6.1f} s: decode {speed:.1f} tok/s, compiled step {probes[-1][2]}")
            time.sleep(every)
        milestones = {"ready_s": round(ready, 1), "first_token_s": round(first_token, 1)}
        return {**milestones, "one_token_s": round(one, 2), "probes": probes}
    finally:
        _stop(proc)
        log.close()


def llama(path: str, gguf: Path) -> dict | None:
    if not (Path(path) / "llama_cpp").is_dir():
        say(f"llama-cpp-python is not in {path}: no llama.cpp row")
        return None
    env = {**os.environ, "PYTHONPATH": path}
    cmd = [sys.executable, "-c", _LLAMA, str(gguf), _PROMPT, repr(time.time())]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout.split()
    loaded, first = (float(x) for x in out)
    return {"loaded_s": round(loaded, 2), "first_token_s": round(first, 2)}


def full_speed_at(probes: list[tuple[float, float, bool, float]], best: float) -> float | None:
    """When a probe first decoded within 10% of ``best`` tokens/s."""
    return next((t for t, speed, *_ in probes if speed >= 0.9 * best), None)


_BUILD = """
import sys, time
from cachegw.backend.executor.layers import cpu_kernels
start = time.perf_counter()
status = cpu_kernels.choose("auto")
print(status.build, time.perf_counter() - start)
"""


def kernel_build(tree: Path) -> dict:
    """The tree's CPU kernels (the build "auto" picks) built into an empty folder: g++'s seconds."""
    with tempfile.TemporaryDirectory(prefix="cachegw-kernels-") as tmp:
        env = {**os.environ, "CACHEGW_KERNEL_CACHE": tmp}
        before = os.times()
        out = subprocess.run(
            [sys.executable, "-c", _BUILD], cwd=tree, env=env, capture_output=True, text=True
        )
        after = os.times()
    build, seconds = out.stdout.split()
    cpu = after.children_user + after.children_system - before.children_user - before.children_system
    return {"build": build, "wall_s": round(float(seconds), 1), "cpu_s_with_python": round(cpu, 1)}


def compare(before: Path, rounds: int, budget: float, every: float, before_budget: float) -> None:
    """First starts of ``before`` (followed ``before_budget`` seconds) and of this tree (``budget``),
    interleaved; each build's own full speed."""
    trees = {"before": before, "after": ROOT}
    budgets = {"before": before_budget, "after": budget}
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    builds = {}
    for name, tree in trees.items():
        builds[name] = kernel_build(tree)
        say(f"{name}: CPU kernels {builds[name]}")
    for r in range(rounds):
        for name, tree in trees.items():
            say(f"round {r + 1}, {name}: first start (empty HOME and TMPDIR)")
            with tempfile.TemporaryDirectory(prefix="cachegw-home-") as tmp:
                runs[name].append(ours(Path(tmp), budgets[name], every, tree, fresh_tmp=True))
    for name in trees:
        best = max(speed for run in runs[name] for _, speed, *_ in run["probes"])
        for run in runs[name]:
            run["full_speed_s"] = full_speed_at(run["probes"], best)
            run["compiled_from_s"] = next((t for t, _, c, _ in run["probes"] if c), None)
            say(f"{name}: {run}")
        builds[name]["best_decode_tok_s"] = best
    save(
        "engine_startup_before_after",
        {
            "model": "SmolLM2-135M-Instruct.Q4_1.gguf",
            "what": "first starts from empty caches, seconds from launch: serving, first token (1-token "
            f"completion), full speed (first {_PROBE_TOKENS}-token probe within 10% of the build's own "
            "best); `cachegw backend` at its defaults; before/after interleaved",
            "trees": {name: str(tree) for name, tree in trees.items()},
            "builds": builds,
            "runs": runs,
        },
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", help="a source tree of an earlier build: compare first starts")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--before-budget", type=float, help="seconds each start of --before is followed")
    ap.add_argument("--budget", type=float, default=420, help="seconds each start is followed")
    ap.add_argument("--warm-budget", type=float, default=150)
    ap.add_argument("--every", type=float, default=5.0, help="seconds between decode probes")
    ap.add_argument("--llama-path", default="/work/llama-peer")
    ap.add_argument("--prepared-home", help="a HOME `make prepare` filled, for the warm start")
    args = ap.parse_args()
    if args.before:
        compare(Path(args.before), args.rounds, args.budget, args.every, args.before_budget or args.budget)
        return
    from cachegw.backend.executor.model_loader import embedded_gguf_path

    gguf = embedded_gguf_path()
    runs: dict[str, dict | None] = {}
    with tempfile.TemporaryDirectory(prefix="cachegw-home-") as tmp:
        home = Path(tmp)
        runs["llama.cpp"] = llama(args.llama_path, gguf)
        say(f"llama.cpp: {runs['llama.cpp']}")
        say("first start (empty caches)")
        runs["first start"] = ours(home, args.budget, args.every)
        say("warm start")
        warm = Path(args.prepared_home) if args.prepared_home else home
        runs["warm start"] = ours(warm, args.warm_budget, args.every)
    best = max(s for r in ("first start", "warm start") for _, s, *_ in runs[r]["probes"])  # type: ignore[index]
    for r in ("first start", "warm start"):
        runs[r]["full_speed_s"] = full_speed_at(runs[r]["probes"], best)  # type: ignore[index]
        runs[r]["compiled_from_s"] = next((t for t, _, c, _ in runs[r]["probes"] if c), None)  # type: ignore[index]
        say(f"{r}: {runs[r]}")
    save(
        "engine_startup",
        {
            "model": gguf.name,
            "what": "seconds from launch: serving, first token (1-token completion), full-speed decode "
            f"(first {_PROBE_TOKENS}-token probe within 10% of the best); `cachegw backend` at its defaults",
            "best_decode_tok_s": best,
            "runs": runs,
        },
    )


if __name__ == "__main__":
    main()
