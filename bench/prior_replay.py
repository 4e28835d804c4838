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
from bench.error_bound import PRIOR_AUDITS, PRIOR_TARGET, banking_replay, labelled_backend, qqp_replay, run
from testkit.servers import serve_in_thread


def prior_main(args: argparse.Namespace) -> None:
    """One scope, target 5%, audits at 50%, no seeds: without a prior, then with the shipped one."""
    sets = {
        "qqp_held_out": qqp_replay(args.data, args.pairs, args.seed, held_out=True),
        "banking77_held_out": banking_replay(args.data, args.texts, args.seed, held_out=True),
    }
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
    save("error_bound_prior", {"args": {k: str(v) for k, v in vars(args).items()}, "results": results})


def mixed_prior(path: Path) -> str:
    """The shipped prior's counts as one family (its families summed): what a single prior does."""
    from cachegw.gateway.cache.prior_loader import SHIPPED

    doc = json.loads(SHIPPED.read_text())
    doc.pop("families")
    path.write_text(json.dumps(doc))
    return str(path)
