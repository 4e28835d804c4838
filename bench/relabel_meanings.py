"""QQP's meanings with the blind re-annotation applied (``bench.error_bound --prior --labels relabelled``).

A graph over the test split's question texts: QQP's duplicate links, minus those both annotators call
not duplicate, plus every pair both call duplicate (``bench/results/qqp_relabel``: key.csv and
judge_<name>.csv); a pair the annotators disagree on keeps QQP's label. Its connected components are
the meanings the replay's labels-following backend answers by. A pair both call not duplicate may stay
joined through other links (a component is transitive); ``Relabelled.still_joined`` counts them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from bench.prior_split import union_find

Rows = list[dict[str, str]]


@dataclass(frozen=True)
class Relabelled:
    find: Callable[[str], str]  # a question text -> its meaning's representative text
    agreed: int  # annotated pairs both annotators judged alike
    disagreed: int  # kept QQP's label
    links_removed: int  # QQP duplicate links both call not duplicate
    links_added: int  # pairs both call duplicate that QQP did not link directly
    still_joined: int  # pairs both call not duplicate that other links still join


def agreed_votes(test: Rows) -> tuple[dict[frozenset[str], int], int]:
    """({question text pair: 1 duplicate / 0 not} where both annotators agree, how many they split)."""
    from bench.verifier_relabel import pair_texts, read_judges, read_key

    judges = read_judges()
    if len(judges) < 2:
        raise SystemExit("error: --labels relabelled needs two annotators' judge_<name>.csv files")
    by_id = {r["id"]: r for r in test}
    agreed: dict[frozenset[str], int] = {}
    split = 0
    for k in read_key():
        votes = {j[k["item"]] for j in judges.values() if k["item"] in j}
        if not all(k["item"] in j for j in judges.values()):
            continue
        if len(votes) == 1:
            agreed[frozenset(pair_texts(k, by_id))] = votes.pop()
        else:
            split += 1
    return agreed, split


def relabelled_meanings(test: Rows) -> Relabelled:
    """The meanings of the test split's questions after the re-annotation (the module docstring)."""
    agreed, split = agreed_votes(test)
    qqp = {frozenset((r["question1"], r["question2"])) for r in test if r["is_duplicate"] == "1"}
    qqp = {e for e in qqp if len(e) == 2}
    removed = {e for e in qqp if agreed.get(e) == 0}
    added = {e for e, v in agreed.items() if v == 1 and e not in qqp and len(e) == 2}
    find = union_find((e[0], e[-1]) for e in sorted(tuple(sorted(e)) for e in (qqp - removed) | added))
    still = sum(1 for e, v in agreed.items() if v == 0 and len(e) == 2 and find(min(e)) == find(max(e)))
    return Relabelled(find, len(agreed), split, len(removed), len(added), still)
