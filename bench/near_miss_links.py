"""Near misses that become hits, measured: the held-out replays of ``bench/prior_split.py`` (QQP pairs,
question 1 then question 2; banking77 texts of 12 intents) through the real gateway at its static
defaults in front of a backend whose answers follow the labels, with ``[cache] near_miss_links`` off
and on. Reported per data set: the hit rate and the wrong share of hits (whole replay and second half),
and how many hits links served and how many of those were wrong. Nothing is fitted: the defaults as
shipped, the held-out half only.

    .venv/bin/python -m bench.near_miss_links [--pairs 1500] [--texts 800]

Writes bench/results/near_miss_links.json.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from bench.common import SHARED_DATA, save, say
from bench.error_bound import banking_replay, labelled_backend, qqp_replay, run
from testkit.servers import serve_in_thread

AUDITS = 0.1  # [cache.audits] fraction as shipped: the share of link hits re-asked


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=1500)
    p.add_argument("--texts", type=int, default=800)
    p.add_argument("--data", type=Path, default=SHARED_DATA)
    p.add_argument("--seed", type=int, default=17)
    args = p.parse_args()
    sets = {
        "qqp_held_out": qqp_replay(args.data, args.pairs, args.seed, held_out=True),
        "banking77_held_out": banking_replay(args.data, args.texts, args.seed, held_out=True),
    }
    results: dict[str, Any] = {}
    for name, (units, answer_of, _) in sets.items():
        with serve_in_thread(labelled_backend(answer_of)) as b:
            results[name] = []
            for links in (False, True):
                r = run(units, answer_of, 0.0, f"{b}/v1", [], audits=AUDITS, over={"near_miss_links": links})
                r["near_miss_links"] = links
                hits = round(r["hit_rate"] * r["requests"])
                say(
                    f"{name} links {links}: hits {hits} ({r['hit_rate']:.3f}), 2nd half "
                    f"{r['hits_second_half']} wrong {r['false_hits_second_half']} "
                    f"({r['false_hit_rate_realized_second_half']:.3f}); link hits {r['link_hits']} "
                    f"wrong {r['link_hits_wrong']}; audits {r['audits_by_verdict']} ({r['seconds']} s)"
                )
                results[name].append(r)
    save("near_miss_links", {"args": {k: str(v) for k, v in vars(args).items()}, "results": results})


if __name__ == "__main__":
    main()
