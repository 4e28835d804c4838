"""The plot of ``bench/kv_routing.py``'s results: per trace and phase, the prompt tokens each routing mode
served from an engine's pool and from the shared Redis tier (stacked), and its TTFT p50.

    .venv/bin/python -m bench.plot_kv_routing [bench/results/kv_routing.json]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.common import RESULTS, say

PHASES = {"before": "before the restart", "after_restart": "after engine 0 restarts"}


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(sys.argv[1]) if len(sys.argv) > 1 else RESULTS / "kv_routing.json"
    traces = json.loads(path.read_text())["traces"]
    fig, axes = plt.subplots(1, 2 * len(traces), figsize=(4 * len(traces) * 2, 3.6))
    for col, (trace, phase) in enumerate((t, p) for t in traces for p in PHASES):
        ax = axes[col]
        modes = list(traces[trace])
        runs = [traces[trace][m][phase] for m in modes]
        pool = [r["hits_by_tier"].get("pool", 0) for r in runs]
        redis = [r["hits_by_tier"].get("redis", 0) for r in runs]
        ax.bar(modes, pool, color="tab:blue", label="from the pool")
        ax.bar(modes, redis, bottom=pool, color="tab:orange", label="loaded from Redis")
        for x, r in enumerate(runs):
            ax.annotate(
                f"{r['ttft_p50_ms']:.0f} ms", (x, pool[x] + redis[x]), ha="center", va="bottom", fontsize=8
            )
        ax.set_ylim(0, 1.15 * max(p + r for p, r in zip(pool, redis, strict=True)))
        ax.set_title(f"{trace}, {PHASES[phase]}", fontsize=9)
        ax.set_ylabel("cached prompt tokens (TTFT p50 above)" if col == 0 else "")
    axes[0].legend(fontsize=8, loc="lower left")
    fig.suptitle(
        "Three engines on one Redis KV tier: where the cached tokens came from, per routing mode", fontsize=10
    )
    fig.tight_layout()
    out = RESULTS / "kv_routing.png"
    fig.savefig(out, dpi=110)
    say(f"wrote {out}")


if __name__ == "__main__":
    main()
