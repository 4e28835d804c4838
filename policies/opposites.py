"""Opposite words from WordNet, for the polarity check on the aligned difference of two queries.

A hand list of antonyms grows with every report ("turn on" / "off", "increase" / "decrease" the volume,
"safe" / "dangerous"). WordNet already records opposites as antonym pointers between word senses, for
adjectives, verbs, adverbs and nouns, and (through "similar to") for the satellites of an adjective
head ("dangerous" is similar to "unsafe", the antonym of "safe"). ``build`` reads the WordNet database
once (Debian's ``wordnet-base``: ``/usr/share/wordnet``) into ``artifacts/opposites.json``, which ships
with the package; at run time only that file is read.

Run ``python -m cachegw.policies.opposites /usr/share/wordnet`` to rebuild it.
"""

from __future__ import annotations

import json
import sys
from functools import lru_cache
from pathlib import Path

ARTIFACT = Path(__file__).resolve().parent / "artifacts" / "opposites.json"
_POS_FILES = {"n": "noun", "v": "verb", "a": "adj", "s": "adj", "r": "adv"}
# Regular inflections tried when a word is not itself in the lexicon: (suffix, replacement).
_SUFFIXES = (
    ("ies", "y"), ("es", ""), ("s", ""), ("ed", ""), ("ed", "e"), ("ing", ""), ("ing", "e"),
    ("er", ""), ("er", "e"), ("est", ""), ("est", "e"), ("ier", "y"), ("iest", "y"), ("ly", ""),
)  # fmt: skip


def _synsets(wn_dir: Path) -> dict[tuple[str, str], tuple[list[str], list[tuple[str, str, str, str]]]]:
    """(offset, file) -> (words, pointers) for every synset of the four data files."""
    out = {}
    for name in ("noun", "verb", "adj", "adv"):
        for line in (wn_dir / f"data.{name}").open(encoding="latin-1"):
            if line.startswith("  "):
                continue  # the license header
            f = line.split(" | ")[0].split()
            n_words = int(f[3], 16)
            words = [f[4 + 2 * i].split("(")[0].lower() for i in range(n_words)]
            k = 4 + 2 * n_words
            n_ptrs = int(f[k])
            ptrs = [
                (f[k + 1 + 4 * i], f[k + 2 + 4 * i], f[k + 3 + 4 * i], f[k + 4 + 4 * i])
                for i in range(n_ptrs)
            ]
            out[(f[0], name)] = (words, ptrs)
    return out


def build(wn_dir: Path) -> dict[str, object]:
    """Single-word opposite pairs (direct antonyms with the first synonyms of both senses, and adjective
    satellites against their head's antonym) and the irregular forms of their words (``better`` ->
    ``good``)."""
    syn = _synsets(wn_dir)
    pairs: set[tuple[str, str]] = set()

    def add(x: str, y: str) -> None:
        if x != y and "_" not in x and "_" not in y and "-" not in x + y and x.isalpha() and y.isalpha():
            pairs.add((min(x, y), max(x, y)))

    for (_, _), (words, ptrs) in syn.items():
        for sym, off, pos, st in ptrs:
            if sym != "!":
                continue
            src, dst = int(st[:2], 16), int(st[2:], 16)
            target = syn.get((off, _POS_FILES[pos]))
            if target and src and dst:
                # the pointer joins two senses; their synonyms in the same sense are opposites too
                # ("hard" shares the sense of "difficult", the antonym of "easy")
                for x in (words[src - 1], *words[:3]):
                    for y in (target[0][dst - 1], *target[0][:3]):
                        add(x, y)
    # "dangerous" (a satellite of "unsafe") against "safe": satellites take their head's antonyms
    for (_, name), (words, ptrs) in syn.items():
        if name != "adj":
            continue
        heads = [syn[(off, "adj")] for sym, off, _, _ in ptrs if sym == "&" and (off, "adj") in syn]
        for _, head_ptrs in heads:
            for sym, off, pos, st in head_ptrs:
                if sym == "!" and (off, _POS_FILES[pos]) in syn:
                    opposite = syn[(off, _POS_FILES[pos])][0][int(st[2:], 16) - 1]
                    for w in words:
                        add(w, opposite)
    vocab = {w for p in pairs for w in p}
    irregular = {}
    for name in ("noun", "verb", "adj", "adv"):
        for line in (wn_dir / f"{name}.exc").open(encoding="latin-1"):
            form, *lemmas = line.split()
            hit = [lemma for lemma in lemmas if lemma in vocab]
            if hit and form not in vocab:
                irregular[form] = hit[0]
    return {
        "source": "WordNet 3.0 antonym pointers (Princeton University; WordNet license)",
        "pairs": sorted(pairs),
        "irregular": dict(sorted(irregular.items())),
    }


@lru_cache(maxsize=1)
def _lexicon() -> tuple[dict[str, frozenset[str]], dict[str, str]]:
    data = json.loads(ARTIFACT.read_text())
    opp: dict[str, set[str]] = {}
    for x, y in data["pairs"]:
        opp.setdefault(x, set()).add(y)
        opp.setdefault(y, set()).add(x)
    return {w: frozenset(s) for w, s in opp.items()}, data["irregular"]


@lru_cache(maxsize=65536)
def lemmas(word: str) -> frozenset[str]:
    """The word and the lexicon words it may inflect ("decreases" -> "decrease", "better" -> "good")."""
    opp, irregular = _lexicon()
    out = {word}
    if word in irregular:
        out.add(irregular[word])
    for suffix, repl in _SUFFIXES:
        if word.endswith(suffix) and len(word) - len(suffix) >= 2:
            stem = word[: -len(suffix)] + repl
            out.add(stem)
            if len(stem) > 2 and stem[-1] == stem[-2]:  # "stopped" -> "stopp" -> "stop"
                out.add(stem[:-1])
    return frozenset(w for w in out if w in opp or w == word)


def _negated_prefix(x: str, y: str) -> bool:
    """ "lock" / "unlock", "mute" / "unmute", "stop" / "nonstop": a negating prefix on the same word."""
    for p in ("un", "non"):
        if (y == p + x or x == p + y) and min(len(x), len(y)) >= 3:
            return True
    return False


def opposite(x: str, y: str) -> bool:
    """Whether two lowercase words are opposites: antonyms in WordNet (through their inflections) or one
    the other with a negating prefix."""
    if x == y:
        return False
    if _negated_prefix(x, y):
        return True
    opp, _ = _lexicon()
    lx, ly = lemmas(x), lemmas(y)
    if lx & ly:
        return False  # inflections of one word
    return any(opp.get(a, frozenset()) & ly for a in lx)


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    wn_dir = Path(args[0] if args else "/usr/share/wordnet")
    data = build(wn_dir)
    ARTIFACT.write_text(json.dumps(data, separators=(",", ":")) + "\n")
    print(f"wrote {ARTIFACT}: {len(data['pairs'])} pairs, {len(data['irregular'])} irregular forms")  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
