"""The false-hit bound from a new deployment's first request: the shipped prior (its calibration
families weighed per scope by the scope's own audits) against no prior and against the same counts as
one mixed prior, one scope, target 5%, audits at 50%, no seeds, replaying only the held-out half of
``bench/prior_split.py`` (the prior counted the other half). Run through ``bench/error_bound.py``:

    .venv/bin/python -m bench.error_bound --prior [--pairs 1500] [--texts 800]

Writes bench/results/error_bound_prior.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from bench.common import save, say
from bench.error_bound import (
    PRIOR_AUDITS,
    PRIOR_TARGET,
    banking_replay,
    labelled_backend,
    qqp_order,
    qqp_replay,
    run,
)
from testkit.servers import serve_in_thread


def prior_main(args: argparse.Namespace) -> None:
    """One scope, target 5%, audits at 50%, no seeds: without a prior, then with the shipped one."""
    sets = {"qqp_held_out": qqp_replay(args.data, args.pairs, args.seed, held_out=True)}
    if args.labels == "relabelled":  # the same replay, its backend answering by the re-annotated meanings
        sets["qqp_held_out_relabelled"] = qqp_replay(args.data, args.pairs, args.seed, True, "relabelled")
    sets["banking77_held_out"] = banking_replay(args.data, args.texts, args.seed, held_out=True)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        priors = {"none": "none", "families": "shipped", "mixed": mixed_prior(Path(tmp) / "mixed.json")}
        for name, (units, answer_of, _) in sets.items():
            with serve_in_thread(labelled_backend(answer_of)) as b:
                results[name] = []
                for label, prior in priors.items():
                    r = run(units, answer_of, PRIOR_TARGET, f"{b}/v1", [], prior, PRIOR_AUDITS)
                    r["prior"] = label
                    say(
                        f"{name} prior {label}: first hit at {r['first_hit_at']}, hits 2nd half "
                        f"{r['hits_second_half']} ({r['hit_rate_second_half']:.3f}), wrong "
                        f"{r['false_hits_second_half']} ({r['false_hit_rate_realized_second_half']:.3f}), "
                        f"line {r['line']}, evidence {r['evidence']}, prior audits "
                        f"{r['prior_audits_at_end']} {r['prior_families_at_end']} ({r['seconds']} s)"
                    )
                    results[name].append(r)
    doc: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "results": results}
    if args.labels == "relabelled":
        doc["relabelled"] = relabel_summary(args)
    save("error_bound_prior" + ("_relabelled" if args.labels == "relabelled" else ""), doc)


def relabel_summary(args: argparse.Namespace) -> dict[str, Any]:
    """How the re-annotation changed the meanings: links removed and added, and the replay's
    candidates (``bench/replay_candidates.py``) whose right/wrong changed, in each direction."""
    from bench.prior_split import meanings
    from bench.relabel_meanings import relabelled_meanings
    from bench.replay_candidates import replay_candidates

    test, _ = qqp_order(args.data, args.seed, held_out=True)
    old, new = meanings(test), relabelled_meanings(test)
    cands = replay_candidates(args.data, args.pairs, args.seed)
    before = [old(c.request) == old(c.stored) for c in cands]
    after = [new.find(c.request) == new.find(c.stored) for c in cands]
    pairs = list(zip(before, after, strict=True))
    return {
        "agreed_pairs": new.agreed,
        "disagreed_pairs_keep_qqp": new.disagreed,
        "qqp_links_removed": new.links_removed,
        "links_added": new.links_added,
        "agreed_not_duplicate_still_joined": new.still_joined,
        "replay_candidates": len(cands),
        "candidates_wrong_by_qqp": before.count(False),
        "candidates_wrong_relabelled": after.count(False),
        "candidates_wrong_to_right": pairs.count((False, True)),
        "candidates_right_to_wrong": pairs.count((True, False)),
        "candidates_wrong_by_band": wrong_by_band(cands, before, after),
    }


def wrong_by_band(cands: list[Any], before: list[bool], after: list[bool]) -> dict[str, list[int]]:
    """Per score band (0.50-0.59 ... 0.90-1.00): [candidates, wrong by QQP, wrong relabelled]."""
    out: dict[str, list[int]] = {}
    for c, b, a in zip(cands, before, after, strict=True):
        lo = min(int(c.score * 10), 9) / 10
        row = out.setdefault(f"{lo:.2f}-{lo + 0.09 if lo < 0.9 else 1.0:.2f}", [0, 0, 0])
        row[0], row[1], row[2] = row[0] + 1, row[1] + (not b), row[2] + (not a)
    return dict(sorted(out.items()))


def mixed_prior(path: Path) -> str:
    """The shipped prior's counts as one family (its families summed): what a single prior does."""
    from cachegw.gateway.cache.prior_loader import SHIPPED

    doc = json.loads(SHIPPED.read_text())
    doc.pop("families")
    path.write_text(json.dumps(doc))
    return str(path)
