"""`cachegw calibrate`: precision/recall of the semantic-cache hit rule against ``[cache] threshold``.

Why: the right threshold depends on the traffic, so it should be read off labelled pairs from that
traffic, scored by the very code the gateway runs: each question becomes the chat body the gateway would
see, is canonicalized, its ``request_keys(...).query`` is embedded with ``Encoder``, and the hit decision
is ``Verifier.check_batch`` with ``DecisionRule(min_cosine=t, min_prob=verifier_threshold)`` (or cosine
alone when the verifier is off). ``check_batch`` runs once, at the lowest threshold of the sweep: its
other checks (guards, probability) do not depend on t, so "accepted at t" is "accepted at 0.50 and
cosine >= t", exactly what a call at t would return, without scoring 51 times.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from cachegw.embeddings.batcher import SupportsEncode
from cachegw.embeddings.encoder import make_encoder
from cachegw.gateway.cache.verifier_loader import load_verifier
from cachegw.policies.cache_keys import request_keys
from cachegw.policies.canonicalize import canonicalize
from cachegw.policies.canonicalize_config import CanonicalizeConfig
from cachegw.policies.verifier import DecisionRule, Verifier, VerifierDataError
from cachegw.policies.verifier_training import read_pairs

log = logging.getLogger(__name__)

THRESHOLDS: tuple[float, ...] = tuple(round(0.50 + 0.01 * k, 2) for k in range(51))
PROGRESS_FROM = 1000  # distinct questions; fewer embed in a few seconds and need no progress bar


class CalibrateError(Exception):
    """Bad input or an impossible request; the message is for the user (exit code 2)."""


@functools.cache
def gateway_encoder(backend: str, int8: bool = False) -> SupportsEncode:
    """The gateway's encoder (``[cache.encoder] backend`` and ``int8``), loaded once per process; all
    cores, since calibration embeds in batches and nothing else runs."""
    return make_encoder(backend, threads=os.cpu_count() or 1, int8=int8)


def gateway_query(question: str, cfg: CanonicalizeConfig) -> str | None:
    """The text the gateway embeds for a one-message chat request (None: no semantic lookup at all)."""
    body, _ = canonicalize({"model": "m", "messages": [{"role": "user", "content": question}]}, cfg)
    return request_keys("calibrate", "m", "chat", body).query


def score_pairs(
    q1: list[str],
    q2: list[str],
    cfg: CanonicalizeConfig,
    verifier: Verifier | None,
    min_prob: float,
    backend: str = "auto",
    int8: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Per pair: the cosine, and whether every check but the cosine floor passes (floor = THRESHOLDS[0])."""
    a = [gateway_query(q, cfg) for q in q1]
    b = [gateway_query(q, cfg) for q in q2]
    ok = [i for i in range(len(a)) if a[i] is not None and b[i] is not None]
    ua, ub = [str(a[i]) for i in ok], [str(b[i]) for i in ok]
    texts = sorted(set(ua) | set(ub))
    log.info("embedding %d distinct questions from %d pairs", len(texts), len(q1))
    emb = gateway_encoder(backend, int8).encode(texts, show_progress=len(texts) >= PROGRESS_FROM)
    row = {t: i for i, t in enumerate(texts)}
    ea, eb = emb[[row[t] for t in ua]], emb[[row[t] for t in ub]]
    cos = np.full(len(q1), -1.0)  # a pair the gateway cannot look up semantically is never a hit
    passes = np.zeros(len(q1), dtype=bool)
    if verifier is not None:
        rule = DecisionRule(min_cosine=THRESHOLDS[0], min_prob=min_prob)
        verdicts = verifier.check_batch(ua, ub, ea, eb, rule)
        cos[ok] = [v.cosine for v in verdicts]
        passes[ok] = [v.accepted for v in verdicts]
    else:  # the index's inner product of the unit vectors the encoder returns
        cos[ok] = [float(c) for c in np.einsum("ij,ij->i", ea, eb)]
        passes[ok] = True
    return cos, passes


def sweep(cos: np.ndarray, passes: np.ndarray, y: np.ndarray, target: float) -> dict[str, Any]:
    """Precision/recall/F1 at each threshold and the recommendation (see ``recommend``)."""
    pos = y > 0.5
    n_pos = int(pos.sum())
    prec: list[float | None] = []
    rec: list[float] = []
    f1: list[float] = []
    accepted: list[int] = []
    for t in THRESHOLDS:
        acc = passes & (cos >= t)
        n, tp = int(acc.sum()), int((acc & pos).sum())
        accepted.append(n)
        prec.append(tp / n if n else None)  # undefined when nothing is accepted
        rec.append(tp / n_pos)
        f1.append(2 * tp / (n + n_pos))  # = 2tp / (2tp + fp + fn)
    best, met = recommend(prec, target)
    return {
        "thresholds": list(THRESHOLDS),
        "precision": [None if p is None else round(p, 4) for p in prec],
        "recall": [round(r, 4) for r in rec],
        "f1": [round(f, 4) for f in f1],
        "accepted": accepted,
        "recommended": THRESHOLDS[best],
        "precision_at_recommended": round(float(prec[best] or 0.0), 4),
        "recall_at_recommended": round(rec[best], 4),
        "f1_at_recommended": round(f1[best], 4),
        "target_precision": target,
        "target_met": met,
        "pairs": len(y),
        "positives": n_pos,
    }


def recommend(precision: list[float | None], target: float) -> tuple[int, bool]:
    """Index of the lowest threshold meeting ``target`` (the most recall that does), and whether one does;
    else of the highest precision (lowest threshold on a tie). Thresholds accepting nothing never count."""
    defined = [(i, p) for i, p in enumerate(precision) if p is not None]
    if not defined:
        raise CalibrateError(f"no pair is accepted at any threshold from {THRESHOLDS[0]} to {THRESHOLDS[-1]}")
    meeting = [i for i, p in defined if p >= target]
    if meeting:
        return meeting[0], True
    return max(defined, key=lambda ip: (ip[1], -ip[0]))[0], False


def write_threshold(path: str, threshold: float) -> None:
    """Set ``[cache] threshold`` in a TOML file, keeping its comments and other keys (or create it)."""
    import tomlkit

    p = Path(path)
    try:
        doc = tomlkit.parse(p.read_text(encoding="utf-8")) if p.exists() else tomlkit.document()
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CalibrateError(f"{p}: cannot read as TOML ({e})") from None
    if "cache" not in doc:
        doc["cache"] = tomlkit.table()
    elif not isinstance(doc["cache"], dict):
        raise CalibrateError(f"{p}: 'cache' is not a table")
    doc["cache"]["threshold"] = threshold  # type: ignore[index]
    try:
        p.write_text(tomlkit.dumps(doc), encoding="utf-8")
    except OSError as e:
        raise CalibrateError(f"{p}: cannot write ({e.strerror})") from None


def plot(path: str, res: dict[str, Any], title: str) -> None:
    """Precision, recall and F1 against threshold, the target and the recommendation marked."""
    from matplotlib.figure import Figure  # no pyplot: no global backend state, Agg by default

    fig = Figure(figsize=(7.5, 4.5))
    ax = fig.subplots()
    t = res["thresholds"]
    ax.plot(t, [np.nan if p is None else p for p in res["precision"]], label="precision")
    ax.plot(t, res["recall"], label="recall")
    ax.plot(t, res["f1"], label="F1")
    ax.axhline(
        res["target_precision"], color="grey", ls=":", label=f"target precision {res['target_precision']}"
    )
    ax.axvline(res["recommended"], color="k", ls="--", label=f"recommended {res['recommended']:.2f}")
    ax.set(xlabel="[cache] threshold (cosine floor)", ylabel="score", ylim=(0, 1.02), title=title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left", fontsize=8)
    try:
        fig.savefig(path, dpi=120, bbox_inches="tight")
    except OSError as e:
        raise CalibrateError(f"{path}: cannot write the plot ({e.strerror})") from None


def _describe(res: dict[str, Any]) -> str:
    rule = f"verifier on (min_prob {res['verifier_threshold']})" if res["verifier"] else "cosine only"
    return f"{res['pairs']} pairs, {res['positives']} duplicates, {rule}"


def print_table(res: dict[str, Any]) -> None:
    """Every 0.05 step plus the recommended row, then the recommendation in one line."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=_describe(res))
    for name in ("threshold", "accepted", "precision", "recall", "F1"):
        table.add_column(name, justify="right")
    rec = THRESHOLDS.index(res["recommended"])
    for i, t in enumerate(THRESHOLDS):
        if i % 5 and i != rec:
            continue
        p = res["precision"][i]
        cells = [f"{t:.2f}", str(res["accepted"][i]), "-" if p is None else f"{p:.3f}"]
        cells += [f"{res['recall'][i]:.3f}", f"{res['f1'][i]:.3f}"]
        table.add_row(*cells, style="bold green" if i == rec else None)
    Console().print(table)
    print(
        f"recommended [cache] threshold = {res['recommended']:.2f}: precision "
        f"{res['precision_at_recommended']:.3f}, recall {res['recall_at_recommended']:.3f} "
        f"(target precision {res['target_precision']}{'' if res['target_met'] else ', NOT met'})"
    )


def _unit_interval(s: str) -> float:
    try:
        p = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {s!r}") from None
    if not 0 < p <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {s}")
    return p


def _positive_int(s: str) -> int:
    if not s.isdigit() or int(s) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {s!r}")
    return int(s)


def main_calibrate(argv: list[str]) -> int:
    """CLI body of ``cachegw calibrate --pairs FILE.csv``; 0 on a result, 2 on bad input."""
    parser = argparse.ArgumentParser(
        prog="cachegw calibrate",
        description="Precision/recall/F1 of the semantic-cache hit rule against [cache] threshold on "
        "labelled pairs (CSV: question1, question2, is_duplicate), scored exactly as the gateway scores.",
    )
    parser.add_argument("--pairs", required=True, help="CSV of labelled pairs")
    parser.add_argument("--config", help="config file merged over the packaged config.toml")
    parser.add_argument("--precision", type=_unit_interval, default=0.95, help="target (default %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the whole sweep as JSON")
    parser.add_argument("--write-config", metavar="FILE", help="set [cache] threshold in this TOML file")
    parser.add_argument("--no-verifier", action="store_true", help="cosine alone, whatever the config says")
    parser.add_argument("--limit", type=_positive_int, metavar="N", help="only the first N pairs")
    parser.add_argument("--plot", metavar="FILE.png", help="plot precision/recall/F1 against threshold")
    parser.add_argument(
        "--seed-evidence",
        metavar="MODEL",
        help="also write the pairs as false-hit evidence of this model into the gateway's database",
    )
    parser.add_argument("--tenant", default="", help="the tenant name (or key hash) of the seeded evidence")
    parser.add_argument(
        "--write-prior",
        metavar="FILE.json",
        help="also write the pairs' counts as a false-hit prior ([cache.error_bound] false_hit_prior = FILE)",
    )
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse has printed "cachegw calibrate: error: ..." already
        return e.code if isinstance(e.code, int) else 2
    try:
        res = _run(args)
        if not res["target_met"]:
            print(
                f"cachegw calibrate: warning: no threshold reaches precision {args.precision}; recommending "
                f"{res['recommended']:.2f}, the most precise ({res['precision_at_recommended']:.3f})",
                file=sys.stderr,
            )
        if args.json:
            print(json.dumps(res))
        else:
            print_table(res)
        if res.get("seeded") is not None:
            note = f"seeded {res['seeded']} candidate pairs as false-hit evidence of {args.seed_evidence}"
            print(note, file=sys.stderr if args.json else sys.stdout)
        if res.get("prior") is not None:
            note = f"wrote a false-hit prior of {res['prior']} candidate pairs to {args.write_prior}"
            print(note, file=sys.stderr if args.json else sys.stdout)
        if args.write_config:
            write_threshold(args.write_config, res["recommended"])
            note = f"wrote [cache] threshold = {res['recommended']} to {args.write_config}"
            print(note, file=sys.stderr if args.json else sys.stdout)
        if args.plot:
            plot(args.plot, res, f"{Path(args.pairs).name}: {_describe(res)}")
    except (CalibrateError, VerifierDataError) as e:
        print(f"cachegw calibrate: error: {e}", file=sys.stderr)
        return 2
    return 0


def _seed(
    settings: Any, model: str, tenant: str, q1: list[str], q2: list[str], y: np.ndarray, verifier
) -> int:
    """The pairs as evidence for the false-hit bound (``gateway/offline/evidence_seed.py``)."""
    from cachegw.gateway.offline.evidence_seed import seed, seed_scores
    from cachegw.gateway.storage.evidence_store import EvidenceStore
    from cachegw.gateway.storage.store import Store

    c = settings.cache
    enc = c.encoder
    scores = seed_scores(q1, q2, settings.canonicalize, verifier, c.threshold, enc.backend, enc.int8)
    store = Store(settings.gateway.resolved_database_url(settings.data_dir))
    try:
        return seed(EvidenceStore(store.session), model, tenant, scores, y)
    finally:
        store.close()


def _write_prior(
    settings: Any, path: str, pairs: str, q1: list[str], q2: list[str], y: np.ndarray, verifier
) -> float:
    """The pairs as a false-hit prior (``gateway/offline/bound_prior.py``); its candidates."""
    from cachegw.gateway.offline.bound_prior import prior_counts, prior_document, sha256, write_prior

    counts = prior_counts(q1, q2, y.astype(bool), settings, verifier)
    data = {Path(pairs).name: {"sha256": sha256(pairs), "pairs": len(q1)}}
    write_prior(path, prior_document(counts, settings, {"data": data, "pairs": len(q1)}))
    return max(c.total for c in counts.values())


def _run(args: argparse.Namespace) -> dict[str, Any]:
    """Read, score and sweep; every expected failure becomes a CalibrateError."""
    from cachegw.gateway.config import load_settings

    try:
        settings = load_settings(args.config)
    except (OSError, ValueError) as e:
        raise CalibrateError(f"config: {e}") from None
    try:
        q1, q2, y = read_pairs(args.pairs)
    except OSError as e:
        raise CalibrateError(f"{args.pairs}: cannot read ({e.strerror})") from None
    if args.limit:
        q1, q2, y = q1[: args.limit], q2[: args.limit], y[: args.limit]
        if len(set(y.tolist())) < 2:
            raise CalibrateError(
                f"the first {args.limit} pairs need both duplicate (1) and non-duplicate (0)"
            )
    use_verifier = settings.cache.verifier.enabled and not args.no_verifier
    try:
        cache_dir = settings.engine.resolved_cache_dir
        verifier = load_verifier(settings.cache, cache_dir) if use_verifier else None
    except (OSError, ValueError) as e:
        raise CalibrateError(f"cannot load the verifier: {e}") from None
    c = settings.cache
    cos, passes = score_pairs(
        q1, q2, settings.canonicalize, verifier, c.verifier.threshold, c.encoder.backend, c.encoder.int8
    )
    res = sweep(cos, passes, y, args.precision)
    if args.seed_evidence:
        res["seeded"] = _seed(settings, args.seed_evidence, args.tenant, q1, q2, y, verifier)
    if args.write_prior:
        res["prior"] = _write_prior(settings, args.write_prior, args.pairs, q1, q2, y, verifier)
    res["verifier"] = use_verifier
    res["verifier_threshold"] = settings.cache.verifier.threshold if use_verifier else None
    res["config"] = args.config
    return res
