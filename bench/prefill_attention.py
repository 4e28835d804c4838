"""What the row kernel's prefill attention costs against torch's, at long prompts (CPU).

On the AVX-512 build every prefill row's attention runs cachegw's row kernel (``cpu_kernels_modules.h``),
so that a prompt's logits do not depend on what the prefix cache held (docs/engine.md). This times
the prefill of one prompt of ``--tokens`` tokens on two engines of the embedded model at the defaults,
side by side in one process and interleaved: one as shipped, one with every prefill chunk on torch's
attention (``PagedAttention.row_prefill = False``, what the AVX2 builds run). No prefix cache.

    .venv/bin/python -m bench.prefill_attention [--tokens 2000,4096] [--runs 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.common import save, say
from bench.kv_dtype import _long_prompt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="2000,4096")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    from cachegw.backend import LLM, SamplingParams
    from cachegw.backend.executor.layers.attention import PagedAttention

    lengths = [int(n) for n in args.tokens.split(",")]
    room = max(lengths) + 64
    engines = {name: LLM(compile="off", kv_cache_tokens=room, max_num_seqs=1, enable_prefix_caching=False)
               for name in ("row kernel (shipped)", "torch attention")}  # fmt: skip
    torch_side = engines["torch attention"]
    for module in torch_side.engine.runner.model.modules():
        if isinstance(module, PagedAttention):
            module.row_prefill = False
    shipped = next(iter(engines.values())).engine.runner.model.layers[0].self_attn.attn
    say(f"shipped engine: row kernel on prefill chunks = {shipped.row_prefill}")
    prompts = {n: _long_prompt(torch_side.tokenizer, n) for n in lengths}
    params = SamplingParams(temperature=0.0, max_tokens=1)
    times: dict[str, dict[int, list[float]]] = {name: {n: [] for n in lengths} for name in engines}
    for llm in engines.values():  # warm-up
        llm.generate([prompts[lengths[0]][:200]], params)
    for r in range(args.runs):
        for n in lengths:
            for name, llm in engines.items():
                start = time.perf_counter()
                llm.generate([prompts[n]], params)
                times[name][n].append(round(time.perf_counter() - start, 3))
        say(f"round {r + 1}: {times}")
    medians = {name: {n: statistics.median(v) for n, v in t.items()} for name, t in times.items()}
    ratio = {n: round(medians["row kernel (shipped)"][n] / medians["torch attention"][n], 2) for n in lengths}
    say(f"medians {medians}; row kernel / torch attention {ratio}")
    save("prefill_attention", {"row_prefill_shipped": shipped.row_prefill, "seconds": times,
                               "median_seconds": medians, "row_over_torch": ratio})  # fmt: skip


if __name__ == "__main__":
    main()
