"""The traces of ``bench/kv_routing.py``: a synthetic multi-tenant chat trace (each tenant's long system
prompt shared by its conversations) and a slice of Mooncake's conversation trace as completions."""

from __future__ import annotations

import json
import random
from pathlib import Path

TOPICS = ("a public library", "a bicycle repair shop", "a mountain hut", "a city museum", "a ferry line")
WORDS = (
    "opening hours members borrow renew reserve catalogue card fee children parents reading room quiet "
    "printing colour computers network bookings weekends holidays tickets refunds lockers cafe garden "
    "exhibition guided tours groups schools discounts accessibility lifts parking bicycles timetable"
).split()


def system_prompt(tenant: int, words: int) -> str:
    rng = random.Random(tenant)
    rules = " ".join(rng.choice(WORDS) for _ in range(words))
    place = TOPICS[tenant % len(TOPICS)]
    return f"You are the assistant of {place}. Answer in one short sentence. Notes: {rules}."


def conversations(tenants: int, per_tenant: int, turns: int, words: int) -> list[tuple[int, str, list[str]]]:
    """(tenant, system prompt, user turns) for every conversation, tenants interleaved."""
    out = []
    for c in range(per_tenant):
        for t in range(tenants):
            rng = random.Random(1000 * t + c)
            users = [
                f"Question {k + 1}: " + " ".join(rng.choice(WORDS) for _ in range(12)) + "?"
                for k in range(turns)
            ]
            out.append((t, system_prompt(t, words), users))
    return out


def mooncake(
    path: Path, conversations: int, tenants: int, words: int, max_ids: int
) -> list[tuple[int, str, list[str]]]:
    """A slice of Mooncake's trace as completions: conversations (requests sharing their first two hash
    ids) of two turns or more, drawn at random (seed 0), each request's prompt the text of its hash ids
    (``words`` seeded words per id; id 0, which every request starts with, is the shared system prompt),
    its first ``max_ids`` ids only. Tenants are dealt round robin."""
    with path.open() as f:
        rows = sorted((json.loads(line) for line in f), key=lambda r: r["timestamp"])
    turns: dict[tuple[int, ...], list[list[int]]] = {}
    for row in rows:
        turns.setdefault(tuple(row["hash_ids"][:2]), []).append(row["hash_ids"][:max_ids])
    keys = sorted(k for k, v in turns.items() if len(v) > 1)
    picked = random.Random(0).sample(keys, conversations)

    def text(h: int) -> str:
        rng = random.Random(h)
        return " ".join(rng.choice(WORDS) for _ in range(words * (8 if h == 0 else 1))) + "\n"

    return [
        (i % tenants, "", ["".join(text(h) for h in ids) for ids in turns[k]]) for i, k in enumerate(picked)
    ]
