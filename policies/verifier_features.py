"""Pair features for the semantic-cache verifier's classifier (numpy + stdlib only).

Cosine similarity of MiniLM embeddings is blind to the few tokens that change an answer: a number,
a negation, a named entity. The guards veto those pairs outright; the lexical features let the learned
classifier weigh softer differences (question word, unshared content words, character overlap).
"""

from __future__ import annotations

from difflib import SequenceMatcher

import numpy as np

from cachegw.policies.pair_guards import entity_mismatch
from cachegw.policies.query_parse import WH_SLOTS, ParsedQuery, parse


def _order_agreement(a: ParsedQuery, b: ParsedQuery) -> float:
    """Fraction of shared content-word pairs in the same order: low for "cats fear tigers" vs the swap."""
    first_b: dict[str, int] = {}
    for i, t in enumerate(b.tokens):
        first_b.setdefault(t, i)
    pos = [first_b[t] for t in dict.fromkeys(a.tokens) if t in b.content and t in a.content]
    n = len(pos)
    if n < 2:
        return 1.0
    concordant = sum(pos[i] < pos[j] for i in range(n) for j in range(i + 1, n))
    return concordant / (n * (n - 1) / 2)


def _jaccard(x: frozenset[str], y: frozenset[str]) -> float:
    union = len(x | y)
    return len(x & y) / union if union else 1.0


LEXICAL_NAMES: tuple[str, ...] = (
    "cosine",
    "token_jaccard",
    "content_jaccard",
    "content_overlap_min",
    "trigram_jaccard",
    "seq_ratio",
    "len_ratio",
    "content_only_min",
    "content_only_max",
    "same_wh",
    "wh_missing",
    "entity_mismatch",
    "entity_any",
    "has_numbers",
    "exact_tokens",
    "order_agreement",
    "person_i_differs",
    "person_you_differs",
    "person_we_differs",
    "question_marks_diff",
    *(f"wh_{w or 'none'}" for w in WH_SLOTS),
)


def lexical_features(q_a: str, q_b: str, cosine: float) -> list[float]:
    """Symmetric hand-made features of one pair, in the order of ``LEXICAL_NAMES``."""
    a, b = parse(q_a), parse(q_b)
    only_a, only_b = len(a.content - b.content), len(b.content - a.content)
    inter = len(a.content & b.content)
    ent = entity_mismatch(a, b)
    return [
        cosine,
        _jaccard(a.token_set, b.token_set),
        _jaccard(a.content, b.content),
        inter / max(min(len(a.content), len(b.content)), 1),
        _jaccard(a.trigrams, b.trigrams),
        SequenceMatcher(None, a.tokens, b.tokens, autojunk=False).ratio(),
        min(a.n_chars, b.n_chars) / max(a.n_chars, b.n_chars, 1),
        np.log1p(min(only_a, only_b)),
        np.log1p(max(only_a, only_b)),
        float(a.wh == b.wh),
        float((a.wh == "") != (b.wh == "")),
        np.log1p(ent),
        float(bool(a.entities or b.entities)),
        float(bool(a.numbers or b.numbers)),
        float(a.tokens == b.tokens),
        _order_agreement(a, b),
        *(float(x != y) for x, y in zip(a.persons, b.persons, strict=True)),
        float(min(abs(a.n_questions - b.n_questions), 3)),
        *(float(a.wh == w) + float(b.wh == w) for w in WH_SLOTS),
    ]


def pair_features(q_new: list[str], q_old: list[str], emb_new: np.ndarray, emb_old: np.ndarray) -> np.ndarray:
    """Feature matrix [n, len(LEXICAL_NAMES) + 2*dim]: lexical features, then |u - v| and u * v."""
    u = np.asarray(emb_new, dtype=np.float32).reshape(len(q_new), -1)
    v = np.asarray(emb_old, dtype=np.float32).reshape(len(q_old), -1)
    cos = np.einsum("ij,ij->i", u, v)
    rows = [lexical_features(a, b, float(c)) for a, b, c in zip(q_new, q_old, cos, strict=True)]
    lex = np.array(rows, dtype=np.float32)
    return np.hstack([lex.reshape(len(q_new), len(LEXICAL_NAMES)), np.abs(u - v), u * v]).astype(np.float32)
