"""Peak memory of `cachegw backend` against llama.cpp on the same GGUF, each answering one request.

Each run starts a fresh process, waits until it is ready, has it answer one chat request (greedy, 16
tokens), then reads its peak resident set (VmHWM in /proc/PID/status) and stops it. Ours is the
`cachegw backend` command at its defaults (the embedded SmolLM2 Q4_1 GGUF, quantization auto, the
decode step compiling in the background). llama.cpp is llama-cpp-python loading the same file in
a process of its own (``--llama-path``: a folder holding the package, put on that process's
PYTHONPATH only; it is a bench peer, never a dependency), with ``--llama-ctx`` positions of KV cache.
``--before DIR``: another build's tree (``git archive REV | tar -x -C DIR``), its `cachegw backend`
measured the same way in the same runs. Runs are interleaved (before, ours, llama.cpp, before, ...),
so the machine's state hits each alike.

    .venv/bin/python -m bench.engine_memory [--runs 3] [--llama-path /work/llama-peer] [--llama-ctx 2048]
        [--before DIR] [--out engine_memory]
    (engine settings from CACHEGW_ENGINE__KEY=value, e.g. __COMPILE=off)
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench.common import ROOT, save, say
from testkit.servers import free_port

_LLAMA = """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=int(sys.argv[2]), n_threads=2, verbose=False)
out = llm.create_chat_completion(
    [{"role": "user", "content": "What is the capital of France?"}], max_tokens=16, temperature=0.0
)
print(out["choices"][0]["message"]["content"].replace("\\n", " "), flush=True)
sys.stdin.readline()  # the parent reads VmHWM, then closes stdin
"""
_QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def peak_mib(pid: int) -> float:
    """The process's peak resident set so far (VmHWM), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM for process {pid}")


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def ours(root: Path = ROOT) -> tuple[float, str]:
    """`cachegw backend` of the tree at ``root`` (its modules first on the path: run from there)."""
    port = free_port()
    cmd = [sys.executable, "-m", "cachegw.gateway.cli", "backend", "--port", str(port)]
    proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"cachegw backend exited with {proc.returncode}")
            try:
                model = httpx.get(f"{url}/models", timeout=2).json()["data"][0]["id"]
                break
            except (httpx.HTTPError, KeyError, ValueError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)
        body = {"model": model, "messages": _QUESTION, "max_tokens": 16, "temperature": 0.0}
        reply = httpx.post(f"{url}/chat/completions", json=body, timeout=300).json()
        return peak_mib(proc.pid), reply["choices"][0]["message"]["content"]
    finally:
        _stop(proc)


def llama(path: str, gguf: Path, n_ctx: int) -> tuple[float, str]:
    env = {**os.environ, "PYTHONPATH": path}
    cmd = [sys.executable, "-c", _LLAMA, str(gguf), str(n_ctx)]
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        answer = proc.stdout.readline().strip()
        if not answer and proc.poll() is not None:
            raise RuntimeError(f"the llama.cpp peer exited with {proc.returncode}")
        peak = peak_mib(proc.pid)
        proc.stdin.close()
        return peak, answer
    finally:
        _stop(proc)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--llama-path", default="/work/llama-peer")
    ap.add_argument("--llama-ctx", type=int, default=2048)
    ap.add_argument("--before", default=None, help="another build's tree, measured in the same runs")
    ap.add_argument("--out", default="engine_memory", help="bench/results/OUT.json")
    args = ap.parse_args()
    from cachegw.backend.executor.model_loader import embedded_gguf_path

    gguf = embedded_gguf_path()
    peer = (Path(args.llama_path) / "llama_cpp").is_dir()
    if not peer:
        say(f"llama-cpp-python is not in {args.llama_path}: measuring ours alone")
    runs: dict[str, list[float]] = {"cachegw backend": [], "llama.cpp": []}
    if args.before:
        runs = {"before": [], **runs}
    answers: dict[str, str] = {}
    for r in range(args.runs):
        if args.before:
            peak, answers["before"] = ours(Path(args.before))
            runs["before"].append(round(peak, 1))
            say(f"run {r + 1}: before ({args.before}) {peak:.0f} MiB")
        peak, answers["cachegw backend"] = ours()
        runs["cachegw backend"].append(round(peak, 1))
        say(f"run {r + 1}: cachegw backend {peak:.0f} MiB")
        if peer:
            peak, answers["llama.cpp"] = llama(args.llama_path, gguf, args.llama_ctx)
            runs["llama.cpp"].append(round(peak, 1))
            say(f"run {r + 1}: llama.cpp {peak:.0f} MiB")
    median = {name: statistics.median(v) for name, v in runs.items() if v}
    ratio = median["cachegw backend"] / median["llama.cpp"] if "llama.cpp" in median else None
    say(f"median peak RSS: {median}; ratio {ratio if ratio is None else round(ratio, 2)}")
    save(
        args.out,
        {
            "model": Path(os.environ.get("CACHEGW_ENGINE__MODEL") or gguf).name,
            "what": "peak RSS (VmHWM) until one chat request (16 tokens) is answered, MiB",
            "llama_cpp": {"package": "llama-cpp-python", "n_ctx": args.llama_ctx, "n_threads": 2},
            "before": args.before,
            "ours": "cachegw backend at its defaults"
            + "".join(f", {k}={v}" for k, v in os.environ.items() if k.startswith("CACHEGW_ENGINE__")),
            "runs": runs,
            "median_mib": median,
            "ratio": None if ratio is None else round(ratio, 2),
            "ratios": {k: round(v / median["llama.cpp"], 2) for k, v in median.items()} if ratio else None,
            "answers": answers,
        },
    )


if __name__ == "__main__":
    main()
