"""bench/results/encoder_choice.json as the markdown tables of docs/verifier.md ("What a semantic hit
runs"): ``python -m bench.encoder_choice --table``."""

from __future__ import annotations

from typing import Any

NAMES = {
    "l6": "MiniLM-L6 (today)",
    "l6-refit": "MiniLM-L6, MLP re-fitted",
    "l3": "paraphrase-MiniLM-L3",
    "mpnet": "all-mpnet-base-v2",
}
DIMS = {"l6": 384, "l3": 384, "mpnet": 768}
ORDER = ("code", "device_action", "doc_instruction", "long_tail", "paraphrase", "units", "yesno_flip", "qqp",
         "banking77")  # fmt: skip


def cell(r: dict[str, Any]) -> str:
    p = "-" if r["precision"] is None else f"{r['precision']:.3f}"
    return f"{p} / {r['recall']:.3f} / {r['false_hits']}"


def rule_text(rule: dict[str, Any] | None) -> str:
    if rule is None:
        return "none qualifies"
    sure = "" if rule["sure"] > 1 else f", skip at {rule['sure']:.3f}"
    return f"cos >= {rule['min_cosine']:.2f}, p >= {rule['min_prob']:.2f}{sure}"


def markdown(res: dict[str, Any]) -> str:
    cands = [n for n, e in res["encoders"].items() if "heldout" in e]
    cols = [("l6", res["today"])] + [(n, res["encoders"][n]) for n in cands]
    head = "| held-out set (pos / neg) | " + " | ".join(NAMES.get(n, n) for n, _ in cols) + " |"
    lines = [head, "|---" * (len(cols) + 1) + "|"]
    rules = ["rule (from calibration)"] + [rule_text(e.get("rule", e.get("reported_at"))) for _, e in cols]
    rules[1] = rule_text(res["today"]["rule"])
    lines.append("| " + " | ".join(rules) + " |")
    for k in ORDER:
        t = res["today"]["heldout"][k]
        row = [f"`{k}` ({t['positives']:,} / {t['negatives']:,})"]
        row += [cell(e["heldout"][k]) for _, e in cols]
        lines.append("| " + " | ".join(row) + " |")
    verdicts = ["issue 31's bar held out", "-"]
    verdicts += ["passes" if e["verdict"]["passes"] else "fails" for _, e in cols[1:]]
    lines.append("| " + " | ".join(verdicts) + " |")
    out = "\n".join(lines)
    auc = res.get("cosine_auc_heldout", {})
    if auc:
        out += "\n\ncosine alone, ROC AUC held out (QQP / banking77): " + "; ".join(
            f"{NAMES.get(n, n)} {a['qqp']:.3f} / {a['banking77']:.3f}" for n, a in auc.items()
        )
    ms = res.get("timing", {}).get("ms")
    if ms:
        out += "\n\n" + cost_table(res, ms, [n for n in DIMS if f"model:{n}" in ms])
    return out


def cost_table(res: dict[str, Any], ms: dict[str, float], names: list[str]) -> str:
    """CPU per query and the estimate per semantic hit, per encoder."""
    per_hit = res.get("cpu_ms_per_hit_estimate", {})
    head = ["encoder", "dims", "model call", "whole call", "align + guards + MLP", "per QQP hit",
            "per banking77 hit"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for n in names:
        h = per_hit.get(n, {})
        row = [NAMES.get(n, n), str(DIMS[n])]
        row += [
            f"{ms[f'{k}:{n}']:.2f} ms" if f"{k}:{n}" in ms else "-"
            for k in ("model", "embed", "align+guards+mlp")
        ]
        row += [f"{h[k]:.1f} ms" if k in h else "-" for k in ("qqp", "banking77")]
        lines.append("| " + " | ".join(row) + " |")
    lines.append(f"\ncross-encoder call: {ms['cross']:.2f} ms; load average {res['timing']['load_average']}")
    return "\n".join(lines)
