"""The plot of ``bench/encoder_choice.py``'s results, with ``bench/refit_spread.py``'s seeds: held-out
precision against recall on QQP and banking77 for each encoder (its MLP re-fitted, its rule from the
calibration sets), today's re-fitted with other seeds at today's rule, and the region issue 31's bar
asks for (at least today's precision and 1.5x its recall).

    .venv/bin/python -m bench.plot_encoder_choice
"""

from __future__ import annotations

import json

from bench.common import RESULTS, say

NAMES = {
    "l6": "MiniLM-L6 (today)",
    "l6-refit": "MiniLM-L6, MLP re-fitted",
    "l3": "paraphrase-MiniLM-L3",
    "mpnet": "all-mpnet-base-v2",
}
SETS = {"qqp": "QQP held-out half", "banking77": "banking77 held-out half"}


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    choice = json.loads((RESULTS / "encoder_choice.json").read_text())
    spread_path = RESULTS / "refit_spread.json"
    seeds = json.loads(spread_path.read_text())["fits"] if spread_path.exists() else {}
    fig, axes = plt.subplots(1, len(SETS), figsize=(11, 4.4))
    for ax, (key, title) in zip(axes, SETS.items(), strict=True):
        today = choice["today"]["heldout"][key]
        bar = (1.5 * today["recall"], today["precision"])  # the corner of what issue 31 asks for
        ax.add_patch(
            Rectangle(
                bar,
                1.0,
                1.0,
                color="tab:green",
                alpha=0.12,
                label="the bar: >= today's precision, >= 1.5x recall",
            )
        )
        ax.axhline(today["precision"], color="grey", linestyle=":", linewidth=1)
        for name, label in NAMES.items():
            r = today if name == "l6" else choice["encoders"][name]["heldout"][key]
            ax.scatter(r["recall"], r["precision"], s=40, label=label, zorder=3)
        runs = [f["heldout"][key] for k, f in seeds.items() if k != "shipped"]
        if runs:
            ax.scatter(
                [r["recall"] for r in runs],
                [r["precision"] for r in runs],
                s=12,
                marker="x",
                color="black",
                label="MiniLM-L6, re-fitted seeds 1-5 (today's rule)",
                zorder=3,
            )
        ax.set_title(title)
        ax.set_xlabel("recall (share of duplicates served)")
        ax.set_ylabel("precision (served answers right)")
        ax.set_xlim(0, max(0.6, 1.6 * today["recall"]))
        shown = [today["precision"]] + [c.get_offsets()[:, 1].min() for c in ax.collections]
        ax.set_ylim(min(shown) - 0.002, today["precision"] + 0.004)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=3)
    fig.suptitle("Query encoders held out: none reaches today's precision at 1.5x its recall", fontsize=11)
    fig.tight_layout(rect=(0, 0.13, 1, 0.95))
    out = RESULTS / "encoder_choice.png"
    fig.savefig(out, dpi=110)
    say(f"wrote {out}")


if __name__ == "__main__":
    main()
