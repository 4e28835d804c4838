"""Draw the engine benchmarks (throughput, prefix-cache TTFT, KV bytes) from their result files.

.venv/bin/python -m bench.plot_engine
"""

from __future__ import annotations

import json

from bench.common import RESULTS, say


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tp = json.loads((RESULTS / "engine_throughput.json").read_text())
    ttft = json.loads((RESULTS / "prefix_cache_ttft.json").read_text())
    kv = json.loads((RESULTS / "kv_memory.json").read_text())
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    ax = axes[0]
    n = max(tp["runs"], key=int)
    rates = {k: e["output_tok_per_s"] for k, e in tp["runs"][n]["engines"].items()}
    rates = {
        (f"{k}\n{tp.get('llamacpp_threads', tp['threads'])} threads" if k.startswith("llama") else k): v
        for k, v in rates.items()
    }
    again = RESULTS / "engine_throughput_vs_llamacpp.json"  # llama.cpp with its own thread count
    if again.exists():
        tl = json.loads(again.read_text())
        rates[f"llama.cpp Q4_1\n{tl['llamacpp_threads']} thread(s), run 2"] = tl["runs"][n]["engines"][
            "llama.cpp Q4_1"
        ]["output_tok_per_s"]
    ax.bar(
        list(rates), list(rates.values()), color=["#2a7" if k.startswith("ours") else "#999" for k in rates]
    )
    ax.tick_params(axis="x", labelsize=7)
    ax.set_title(
        f"{n} concurrent requests: ours {tp['runs'][n]['ours_vs']['HF float32']}x HF static batches",
        fontsize=9,
    )
    ax.set_ylabel("output tokens / s")
    ax = axes[1]
    vals = [ttft["hf_forward_ms"], ttft["ttft_cold_ms"], ttft["ttft_cached_ms"]]
    ax.bar(["HF forward", "ours, cold", "ours, 1,984 cached"], vals, color=["#999", "#8bc", "#2a7"])
    ax.set_yscale("log")
    ax.set_title(f"TTFT of a 2,000-token prompt: {ttft['speedup_vs_cold']}x")
    ax.set_ylabel("ms (log)")
    ax = axes[2]
    rows = kv["rows"]
    x = range(len(rows))
    ax.bar(
        [i - 0.2 for i in x], [r["formula_bytes_per_token"] for r in rows], 0.4, label="formula", color="#999"
    )
    ax.bar(
        [i + 0.2 for i in x],
        [r["rss_bytes_per_token"] for r in rows],
        0.4,
        label="measured (RSS)",
        color="#2a7",
    )
    ax.set_xticks(list(x), [r["dtype"] for r in rows])
    ax.set_title("KV bytes per token")
    ax.legend()
    fig.tight_layout()
    out = RESULTS / "engine.png"
    fig.savefig(out, dpi=110)
    say(f"wrote {out}")


if __name__ == "__main__":
    main()
