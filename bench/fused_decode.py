"""Decode steps of the fused step against the eager modules and the compiled step (torch.compile), at
batch 1 and 8, in one process, interleaved round by round.

The embedded SmolLM2 (Q4_1 as int4 on cachegw's kernels, float32 activations and KV), greedy, EOS
ignored: each batch size's requests (200-token prompts) are prefilled, warmed for a few steps, then
``--steps`` decode-only steps are timed; each engine's best of ``--rounds`` is kept (a shared machine
only ever slows a round down). The compiled engine compiles before the runs (minutes the first time on
a machine; Inductor's cache after; left out when not ready within ``--compile-wait`` seconds).

    .venv/bin/python -m bench.fused_decode [--rounds 3] [--steps 24] [--no-compiled]
"""

from __future__ import annotations

import argparse
import time

from bench.common import save, say
from bench.peers import load_average

_MODES = {
    "fused": dict(fused_decode=True, compile="off"),
    "eager": dict(fused_decode=False, compile="off"),
    "compiled": dict(fused_decode=False, compile="background"),
}


def step_ms(llm, batch: int, steps: int, tag: str) -> float:
    """Milliseconds per decode-only step with ``batch`` sequences running."""
    from cachegw.backend import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 12, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", [100 + (i * 37 + j) % 40000 for j in range(200)], params)
    for _ in range(batch + 6):  # prefills, then a few warm decode steps
        engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = (time.perf_counter() - start) / steps * 1000
    while engine.has_unfinished_requests():
        engine.step()
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--no-compiled", action="store_true")
    ap.add_argument("--compile-wait", type=float, default=240, help="seconds the compiled step may take")
    args = ap.parse_args()
    from cachegw.backend import LLM

    modes = [m for m in _MODES if not (args.no_compiled and m == "compiled")]
    engines = {}
    for mode in modes:
        start = time.perf_counter()
        options = dict(kv_cache_tokens=8192, max_num_seqs=8, enable_prefix_caching=False, **_MODES[mode])
        engines[mode] = LLM(dtype="float32", **options)
        say(f"{mode}: built in {time.perf_counter() - start:.0f} s")
    assert engines["fused"].engine.runner.fused is not None
    compiled = engines["compiled"].engine.runner.compiled if "compiled" in engines else None
    if compiled is not None:  # compiled in a thread: measured only if ready in time
        deadline = time.monotonic() + args.compile_wait
        while not (compiled.ready or compiled.failed) and time.monotonic() < deadline:
            time.sleep(1)
        if not compiled.ready:
            say(f"compiled step not ready after {args.compile_wait:.0f} s ({compiled.failed}): left out")
            del engines["compiled"]
            modes.remove("compiled")
    times: dict[str, dict[int, list[float]]] = {m: {1: [], 8: []} for m in modes}
    load = [load_average()]
    for r in range(args.rounds):
        for batch in (1, 8):
            for mode, llm in engines.items():
                times[mode][batch].append(round(step_ms(llm, batch, args.steps, f"{mode}{r}{batch}"), 2))
                say(f"round {r + 1} batch {batch} {mode}: {times[mode][batch][-1]} ms a step")
        load.append(load_average())
    best = {m: {b: min(v) for b, v in per.items()} for m, per in times.items()}
    result = {
        m: {
            f"batch_{b}": {
                "ms_per_step": times[m][b],
                "best_ms": best[m][b],
                "tok_per_s": round(b * 1000 / best[m][b], 1),
                "time_vs_fused": round(best[m][b] / best["fused"][b], 2),
            }
            for b in (1, 8)
        }
        for m in modes
    }
    save(
        "fused_decode",
        {
            "model": "SmolLM2-135M-Instruct.Q4_1.gguf (int4 on cachegw's kernels, float32)",
            "steps": args.steps,
            "load_average_1min": load,
            "compile_seconds": round(compiled.compile_seconds, 1) if compiled and compiled.ready else None,
            "compiled_steps_run": compiled.steps if compiled else 0,
            "fused_steps_run": engines["fused"].engine.runner.fused.steps,
            "modes": result,
        },
    )


if __name__ == "__main__":
    main()
