"""What `[engine] kv_write_behind` costs: the CPU time its copies take on the engine thread and its writes
on the tier's worker, against the CPU time of the prefill that filled those blocks.

One engine on the embedded SmolLM2 (in process, compile off) with a disk tier and write-behind on; each
repeat prefills a new random prompt of ``--tokens`` tokens (``max_tokens`` 1). The copy (``filled``) and
the write (``_write_behind``) are timed with ``time.thread_time`` (CPU seconds of the thread that runs
them), so the figure does not depend on what else the shared machine runs; the prefill's CPU seconds are
the process's CPU time over the request minus the worker's.

    flock /tmp/cachegw-bench.lock .venv/bin/python -m bench.kv_write_behind [--tokens 2000] [--repeats 2]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from collections.abc import Callable
from typing import Any

from bench.common import save, say
from cachegw.backend import LLM, SamplingParams


def timed(fn: Callable[..., Any], into: list[float]) -> Callable[..., Any]:
    def wrapper(*args: Any) -> Any:
        t0 = time.thread_time()
        try:
            return fn(*args)
        finally:
            into.append(time.thread_time() - t0)

    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--model", default="", help="a model other than the embedded SmolLM2")
    args = ap.parse_args()
    rng = random.Random(7)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kv-wb-") as tmp:
        llm = LLM(args.model, kv_offload_dir=tmp, kv_write_behind=True, compile="off")
        tier = llm.engine.kv_tier
        assert tier is not None
        copies: list[float] = []
        writes: list[float] = []
        tier.filled = timed(tier.filled, copies)  # type: ignore[method-assign]
        tier._write_behind = timed(tier._write_behind, writes)  # type: ignore[method-assign]
        params = SamplingParams(temperature=0.0, max_tokens=1)
        for rep in range(args.repeats):
            copies.clear()
            writes.clear()
            prompt = [rng.randrange(100, 49000) for _ in range(args.tokens)]
            cpu0, wall0 = time.process_time(), time.perf_counter()
            llm.generate(prompt, params)
            tier.flush()
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
            prefill_cpu = cpu - sum(writes)
            row = {
                "repeat": rep, "blocks": len(copies), "block_bytes": tier.block_bytes,
                "copy_cpu_ms_per_block": round(1000 * sum(copies) / max(len(copies), 1), 3),
                "write_cpu_ms_per_block": round(1000 * sum(writes) / max(len(writes), 1), 3),
                "prefill_cpu_s": round(prefill_cpu, 2), "wall_s": round(wall, 2),
                "engine_thread_share": round(sum(copies) / prefill_cpu, 4),
                "worker_share": round(sum(writes) / prefill_cpu, 4),
            }  # fmt: skip
            say(str(row))
            rows.append(row)
        llm.engine.close()
    save("kv_write_behind", {"rows": rows, "args": vars(args)})


if __name__ == "__main__":
    main()
