"""Multi-turn traffic: hit rate and false hits of the gateway against the keys peers use.

Wrong answers in multi-turn traffic are what semantic caches' users report most: a follow-up like
"continue" means something else in every conversation, and a cache keyed on the last message serves
one conversation's continuation to another. This benchmark replays real conversations with follow-ups
whose right answer is known, through the real gateway at its defaults in front of a backend whose
answers follow the labels, and replays the same sequence through the keys peers use, simulated with
the same encoder: the last user message only (GPTCache's default pre-processing), the last three
messages, and the whole conversation as one text (a prompt-keyed cache), each at a sweep of cosine
thresholds.

Families (every history is a real ShareGPT conversation's opening, ``../shared/data/sharegpt_dev.jsonl``):

- ``recurring``: follow-ups that recur across conversations in the data (``continue``, ``please
  continue``, ``more``, ...; groups found by the text, not chosen), each sent after its own
  conversation's history. The right answer depends on the history: a hit across two different
  histories is a false hit (identical histories, which the data holds a few of, are the same request).
- ``paraphrase``: a held-out QQP pair (``bench/prior_split.qqp_parts``) asked as the next turn of
  one history, question 1 then question 2: duplicates should hit, non-duplicates must not.
- ``cross``: a QQP duplicate pair asked after two different histories. Whether a hit is right is
  arguable (the question does not refer to the history); it is reported apart, never as a right hit.

Right = the served answer's label equals the label of the request's own (history, meaning).

    .venv/bin/python -m bench.multi_turn [--conversations 160] [--pairs 160] [--data DIR]

Writes bench/results/multi_turn.json and .png.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import hashlib
import json
import random
import re
import tempfile
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.common import RESULTS, SHARED_DATA, save, say
from bench.error_bound import MODEL, labelled_backend
from bench.prior_split import qqp_parts
from testkit.servers import serve_in_thread

CLIENT_KEY = {"authorization": "Bearer bench"}
THRESHOLDS = (0.80, 0.85, 0.88, 0.90, 0.92, 0.95, 0.98)
HISTORY_CHARS = 1500  # each history message cut to this many characters (requests stay small)
PEERS = {"last message": 1, "last 3 messages": 3, "whole conversation": 0}


def norm(text: str) -> str:
    return " ".join(re.sub(r"[^a-z0-9 ]", " ", text.lower()).split())


@dataclass
class Turn:
    """One request: a history (alternating user/assistant messages) and the follow-up asked after it."""

    family: str
    history: list[dict[str, str]]
    question: str
    meaning: str  # the follow-up's meaning class (QQP's duplicate links, or the follow-up's own text)
    should_hit: bool = False  # an earlier request of the replay has the same label
    label: str = field(default="")

    def messages(self) -> list[dict[str, str]]:
        return [*self.history, {"role": "user", "content": self.question}]


def label_of(history: list[dict[str, str]], meaning: str) -> str:
    """The right answer: one per (history, meaning), whatever the exact wording."""
    h = hashlib.sha1("\n".join(norm(m["content"]) for m in history).encode()).hexdigest()[:12]
    return f"answer {h}:{hashlib.sha1(meaning.encode()).hexdigest()[:12]}"


def histories(
    data: Path,
) -> tuple[list[list[dict[str, str]]], dict[str, list[tuple[list[dict[str, str]], str]]]]:
    """Openings of real conversations (first user message and the reply), and every later user turn
    with the history before it, grouped by the turn's normalized text."""
    role = {"human": "user", "gpt": "assistant"}
    openings: list[list[dict[str, str]]] = []
    followups: dict[str, list[tuple[list[dict[str, str]], str]]] = defaultdict(list)
    for line in open(data / "sharegpt_dev.jsonl", encoding="utf-8"):
        turns = [t for t in json.loads(line)["conversations"] if t["from"] in role and t["value"].strip()]
        msgs = [{"role": role[t["from"]], "content": t["value"][:HISTORY_CHARS]} for t in turns]
        if len(msgs) < 2 or msgs[0]["role"] != "user" or msgs[1]["role"] != "assistant":
            continue
        openings.append(msgs[:2])
        for i in range(2, len(msgs)):
            if msgs[i]["role"] == "user" and msgs[i - 1]["role"] == "assistant" and norm(msgs[i]["content"]):
                followups[norm(msgs[i]["content"])].append((msgs[:i][-4:], msgs[i]["content"]))
    return openings, followups


def replay_turns(data: Path, conversations: int, pairs: int, seed: int) -> list[Turn]:
    rng = random.Random(seed)
    openings, followups = histories(data)
    occurrences = [(k, h, q) for k, v in followups.items() if len(v) >= 2 for h, q in v]
    units = [
        [Turn("recurring", h, q, k)]
        for k, h, q in rng.sample(occurrences, min(conversations, len(occurrences)))
    ]
    with open(data / "qqp_dev.csv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    _, held = qqp_parts(rows)
    links: dict[str, str] = {}

    def root(q: str) -> str:
        while links.get(q, q) != q:
            q = links[q]
        return q

    for r in held:  # duplicate links join meanings, as bench/error_bound.py's backend answers
        if r["is_duplicate"] == "1":
            a, b = root(norm(r["question1"])), root(norm(r["question2"]))
            if a != b:
                links[a] = b
    dup = [r for r in held if r["is_duplicate"] == "1"]
    non = [r for r in held if r["is_duplicate"] != "1"]
    picked = rng.sample(dup, pairs // 2) + rng.sample(non, pairs // 2)
    for r in picked:  # one history, question 1 then question 2
        h = rng.choice(openings)
        units.append([Turn("paraphrase", h, q, root(norm(q))) for q in (r["question1"], r["question2"])])
    for r in rng.sample([r for r in dup if r not in picked], pairs // 2):  # two histories
        h1, h2 = rng.sample(openings, 2)
        units.append(
            [Turn("cross", h, q, root(norm(q))) for h, q in ((h1, r["question1"]), (h2, r["question2"]))]
        )
    rng.shuffle(units)
    turns = [t for u in units for t in u]
    seen: set[str] = set()
    for t in turns:
        t.label = label_of(t.history, t.meaning)
        t.should_hit = t.label in seen
        seen.add(t.label)
    return turns


def answer_by_messages(answer: dict[str, str]) -> Callable[[dict[str, Any]], str]:
    """The label of a request found by its messages' normalized text (a stable unknown one otherwise)."""

    def label(body: dict[str, Any]) -> str:
        key = "\n".join(norm(str(m.get("content") or "")) for m in body["messages"])
        return answer.get(key) or f"unknown {hashlib.sha1(key.encode()).hexdigest()[:12]}"

    return label


@contextlib.contextmanager
def gateway(backend: str, work: Path) -> Iterator[str]:
    from cachegw.gateway.api.app import build_app
    from cachegw.gateway.compose import started_gateway
    from cachegw.gateway.config import load_settings

    s = load_settings(None, data_dir=str(work), backends=(backend,))
    with serve_in_thread(build_app(lambda: started_gateway(s, progress=False)), lifespan="on") as url:
        yield url


def ours(turns: list[Turn]) -> tuple[list[str | None], dict[str, int]]:
    """Each turn through the real gateway at its defaults: the label served on a semantic or exact hit
    (None on a miss), and the gateway's reasons for its misses."""
    answer = {"\n".join(norm(m["content"]) for m in t.messages()): t.label for t in turns}
    served: list[str | None] = []
    reasons: dict[str, int] = defaultdict(int)
    with (
        serve_in_thread(labelled_backend(answer_by_messages(answer))) as backend,
        tempfile.TemporaryDirectory() as work,
        gateway(f"{backend}/v1", Path(work)) as url,
        httpx.Client(timeout=120) as client,
    ):
        for i, t in enumerate(turns):
            body = {"model": MODEL, "messages": t.messages(), "temperature": 0, "max_tokens": 16}
            r = client.post(f"{url}/v1/chat/completions", json=body, headers=CLIENT_KEY)
            if r.status_code != 200:
                raise RuntimeError(f"{r.status_code}: {r.text[:300]}")
            hit = r.headers.get("x-cache", "miss") in ("semantic-hit", "exact-hit")
            served.append(r.json()["choices"][0]["message"]["content"] if hit else None)
            if not hit:
                reasons[r.headers.get("x-cache-reason", "?")] += 1
            if (i + 1) % 100 == 0:
                say(f"gateway: {i + 1}/{len(turns)}")
    return served, dict(reasons)


def peer_keys(turns: list[Turn], window: int) -> list[str]:
    """The text a peer embeds: the last ``window`` messages joined (0: the whole conversation)."""
    msgs = [t.messages() for t in turns]
    return ["\n".join(m["content"] for m in (ms if window == 0 else ms[-window:])) for ms in msgs]


def peer(emb: np.ndarray, turns: list[Turn], threshold: float) -> list[str | None]:
    """A cache keyed by one embedding: the nearest stored key at or over ``threshold`` serves its
    answer; a miss stores its own."""
    served: list[str | None] = []
    keys: list[np.ndarray] = []
    labels: list[str] = []
    for e, t in zip(emb, turns, strict=True):
        if keys:
            sims = np.stack(keys) @ e
            j = int(np.argmax(sims))
            if sims[j] >= threshold:
                served.append(labels[j])
                continue
        served.append(None)
        keys.append(e)
        labels.append(t.label)
    return served


def score(turns: list[Turn], served: list[str | None]) -> dict[str, Any]:
    """Per family: hits, right and false hits, and recall over the turns whose right answer was stored
    before them. ``total`` adds recurring and paraphrase; cross-history hits are only counted."""
    out: dict[str, Any] = {}
    for fam in ("recurring", "paraphrase", "cross", "total"):
        idx = [i for i, t in enumerate(turns) if t.family == fam or (fam == "total" and t.family != "cross")]
        hits = [i for i in idx if served[i] is not None]
        right = [i for i in hits if served[i] == turns[i].label]
        should = [i for i in idx if turns[i].should_hit]
        out[fam] = {"requests": len(idx), "hits": len(hits)}
        if fam != "cross":
            out[fam] |= {
                "right_hits": len(right),
                "false_hits": len(hits) - len(right),
                "false_hit_share": round((len(hits) - len(right)) / len(hits), 4) if hits else None,
                "recall": round(len([i for i in should if served[i] == turns[i].label]) / len(should), 4)
                if should
                else None,
            }
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, runs in result["peers"].items():
        xs = [r["scores"]["total"]["false_hits"] for r in runs]
        ys = [r["scores"]["paraphrase"]["recall"] or 0 for r in runs]
        ax.plot(xs, ys, marker="o", label=f"{name} (cosine {THRESHOLDS[0]}-{THRESHOLDS[-1]})")
    g = result["gateway"]["scores"]
    ax.scatter(
        [g["total"]["false_hits"]],
        [g["paraphrase"]["recall"] or 0],
        s=90,
        c="k",
        marker="*",
        label="cachegw defaults",
        zorder=5,
    )
    ax.set_xlabel("false hits in the replay (recurring follow-ups + non-duplicate paraphrases)")
    ax.set_ylabel("recall of duplicate follow-ups in one conversation")
    ax.set_title("Multi-turn traffic: right hits against false hits")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    say(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=160, help="recurring follow-ups replayed")
    ap.add_argument("--pairs", type=int, default=160, help="QQP pairs as follow-ups (half duplicates)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--data", type=Path, default=SHARED_DATA)
    args = ap.parse_args()
    turns = replay_turns(args.data, args.conversations, args.pairs, args.seed)
    say(
        f"{len(turns)} turns: "
        + ", ".join(f"{f} {sum(t.family == f for t in turns)}" for f in ("recurring", "paraphrase", "cross"))
    )
    served, reasons = ours(turns)
    result: dict[str, Any] = {
        "command": "python -m bench.multi_turn "
        + " ".join(f"--{k} {v}" for k, v in vars(args).items() if k != "data"),
        "turns": {f: sum(t.family == f for t in turns) for f in ("recurring", "paraphrase", "cross")},
        "should_hit": {
            f: sum(t.should_hit and t.family == f for t in turns)
            for f in ("recurring", "paraphrase", "cross")
        },
        "gateway": {"scores": score(turns, served), "miss_reasons": reasons},
        "peers": {},
    }
    from cachegw.gateway.offline.calibrate import gateway_encoder

    encoder = gateway_encoder("auto")
    for name, window in PEERS.items():
        emb = encoder.encode(peer_keys(turns, window))
        result["peers"][name] = [
            {"threshold": th, "scores": score(turns, peer(emb, turns, th))} for th in THRESHOLDS
        ]
        say(f"peer {name!r} done")
    save("multi_turn", result)
    plot(result, RESULTS / "multi_turn.png")


if __name__ == "__main__":
    main()
