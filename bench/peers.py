"""The engines the engine benchmarks compare, each in a worker process of its own.

Its own process gives each engine its own peak RSS (reported when it stops), its own torch/OpenMP
threads, and lets a benchmark keep every engine loaded while it interleaves their runs, so drift in
the machine's load hits them alike. Engines: ours in a weight mode (``[engine] quantization``),
llama.cpp (llama-cpp-python, a bench peer only, not a dependency) on the same GGUF file, and Hugging
Face transformers in float32 on our converted weights.

A worker answers two requests: ``single`` (one prompt alone, greedy, EOS ignored: time to first token
and decode speed) and ``batch`` (many requests as the engine serves them: ours all at once with
continuous batching, HF in static batches, llama.cpp one after another).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import resource
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NamedTuple

Work = list[tuple[list[int], int]]  # (prompt token ids, output tokens), EOS ignored


class Speed(NamedTuple):
    """One request alone: seconds to the first token, the prompt's tokens per second of that, and
    decode tok/s (the tokens after the first over the time after the first; 0 with one token)."""

    ttft: float
    prefill: float
    decode: float


def _speed(prompt: list[int], new: int, start: float, first: float, end: float) -> Speed:
    decode = (new - 1) / (end - first) if new > 1 else 0.0
    return Speed(first - start, len(prompt) / (first - start), decode)


class _Ours:
    def __init__(self, threads: int, **llm_options: Any) -> None:
        import torch

        torch.set_num_threads(threads)
        from cachegw.backend import LLM

        # A compile running in the background would share the cores with the runs measured: off
        # unless asked for ("startup" compiles before the worker reports ready).
        self.llm = LLM(dtype="float32", **{"compile": "off", **llm_options})

    def single(self, prompt: list[int], new: int) -> Speed:
        from cachegw.backend import SamplingParams

        engine = self.llm.engine
        params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
        start, first, done = time.perf_counter(), 0.0, False
        engine.add_request(f"single-{start}", prompt, params)
        while not done:
            outs = engine.step()
            if not first and outs:
                first = time.perf_counter()
            done = any(o.finished for o in outs)
        return _speed(prompt, new, start, first, time.perf_counter())

    def batch(self, work: Work) -> float:
        from cachegw.backend import SamplingParams

        params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in work]
        start = time.perf_counter()
        outs = self.llm.generate([p for p, _ in work], params)
        elapsed = time.perf_counter() - start
        assert [len(o.outputs[0].token_ids) for o in outs] == [m for _, m in work]
        return elapsed


class _LlamaCpp:
    def __init__(self, threads: int, path: str, n_ctx: int = 1024) -> None:
        from llama_cpp import Llama

        self.llm = Llama(
            model_path=path,
            n_threads=threads,
            n_threads_batch=threads,
            n_ctx=n_ctx,
            n_batch=512,
            verbose=False,
        )

    def single(self, prompt: list[int], new: int) -> Speed:
        self.llm.reset()
        start = time.perf_counter()
        self.llm.eval(prompt)
        token = self.llm.sample(temp=0.0)
        first = time.perf_counter()
        for _ in range(new - 1):
            self.llm.eval([token])
            token = self.llm.sample(temp=0.0)
        return _speed(prompt, new, start, first, time.perf_counter())

    def batch(self, work: Work) -> float:
        """One request after another: llama-cpp-python's server has no parallel slots."""
        start = time.perf_counter()
        for prompt, new in work:
            self.single(prompt, new)
        return time.perf_counter() - start


class _HF:
    def __init__(self, threads: int, static_batch: int = 16) -> None:
        import torch

        torch.set_num_threads(threads)
        from transformers import AutoModelForCausalLM

        from cachegw.backend.config import load_engine_config
        from cachegw.backend.executor.model_loader import resolve_model_dir

        cfg = load_engine_config(None)
        folder = resolve_model_dir(cfg.model, cfg.resolved_cache_dir)
        self.model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        self.static_batch = static_batch

    def _generate(self, ids, mask, new: int) -> None:
        import torch

        with torch.no_grad():
            self.model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )

    def single(self, prompt: list[int], new: int) -> Speed:
        """`generate` for one token (the time to first token), then for ``new`` if more are asked."""
        import torch

        ids = torch.tensor([prompt])
        start = time.perf_counter()
        self._generate(ids, torch.ones_like(ids), 1)
        first = time.perf_counter()
        if new == 1:
            return _speed(prompt, 1, start, first, first)
        ttft, again = first - start, time.perf_counter()
        self._generate(ids, torch.ones_like(ids), new)
        return Speed(ttft, len(prompt) / ttft, (new - 1) / (time.perf_counter() - again - ttft))

    def batch(self, work: Work) -> float:
        """Static batches (left-padded, as decoder-only `generate` needs): a batch lasts until its
        longest output."""
        import torch

        start = time.perf_counter()
        for b in range(0, len(work), self.static_batch):
            chunk = work[b : b + self.static_batch]
            width = max(len(p) for p, _ in chunk)
            ids = torch.full((len(chunk), width), 0, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, (p, _) in enumerate(chunk):
                ids[i, width - len(p) :] = torch.tensor(p)
                mask[i, width - len(p) :] = 1
            self._generate(ids, mask, max(m for _, m in chunk))
        return time.perf_counter() - start


_ENGINES = {"ours": _Ours, "llama.cpp": _LlamaCpp, "hf": _HF}


def _worker(kind: str, options: dict[str, Any], cpus: list[int] | None, conn: Connection) -> None:
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    if os.environ.get("PYTHONPATH"):  # spawn gives the child its parent's sys.path: put ours first
        sys.path[:0] = os.environ["PYTHONPATH"].split(os.pathsep)
    engine = _ENGINES[kind](**options)
    conn.send("ready")
    while (msg := conn.recv()) != "stop":
        op, *args = msg
        conn.send(getattr(engine, op)(*args))
    conn.send(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


class Peer:
    """The parent's handle on one engine's worker: started loaded, asked, stopped for its peak RSS.

    ``env``: variables the worker starts with (OpenMP reads them once); ``cpus``: the cores it is
    bound to. ``options``: ``threads`` and the engine's own (ours: ``LLM`` keywords; llama.cpp:
    ``path``, ``n_ctx``; hf: ``static_batch``)."""

    def __init__(
        self,
        name: str,
        kind: str,
        env: dict[str, str] | None = None,
        cpus: list[int] | None = None,
        **options: Any,
    ) -> None:
        self.name = name
        saved = dict(os.environ)
        os.environ.update(env or {})  # a spawned child copies the environment at start
        try:
            ctx = mp.get_context("spawn")
            self._conn, there = ctx.Pipe()
            self._proc = ctx.Process(target=_worker, args=(kind, options, cpus, there), daemon=True)
            self._proc.start()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        assert self._conn.recv() == "ready"

    def single(self, prompt: list[int], new: int) -> Speed:
        self._conn.send(("single", prompt, new))
        return self._conn.recv()

    def batch(self, work: Work) -> float:
        self._conn.send(("batch", work))
        return self._conn.recv()

    def stop(self) -> int:
        """Ends the worker; its peak RSS in MiB."""
        self._conn.send("stop")
        rss = round(self._conn.recv())
        self._proc.join(10)
        return rss


def torch_env(threads: int) -> dict[str, str]:
    """The OpenMP wait policy `cachegw backend` gives torch with several threads (passive: spinning
    threads collapse beside other work, backend/executor/cpu_threads.py); the HF peer gets the same."""
    return {"OMP_WAIT_POLICY": "PASSIVE"} if threads > 1 else {}


def llamacpp_builds(spec: str) -> list[tuple[str, dict[str, str]]]:
    """``--llama`` as (peer name, worker environment) per llama-cpp-python build: "" = the installed
    package, if any ("llama.cpp"); "avx2=/work/llama-peer-avx2,native=/work/llama-peer" = each
    folder (a ``pip install --target``) on its worker's PYTHONPATH only ("llama.cpp avx2" ...).
    A folder without the package is skipped with a message."""
    if not spec:
        return [("llama.cpp", {})] if llamacpp_installed() else []
    builds = []
    for item in spec.split(","):
        name, _, folder = item.partition("=")
        if not (Path(folder) / "llama_cpp").is_dir():
            print(f"no llama_cpp package in {folder!r}: skipping the llama.cpp {name} peer", flush=True)
            continue
        builds.append((f"llama.cpp {name}", {"PYTHONPATH": folder}))
    return builds


def llamacpp_installed() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def load_average() -> float:
    """uptime's 1-minute load average."""
    return round(os.getloadavg()[0], 2)
