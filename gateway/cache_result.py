"""How the cache answered a request: the one enum of results, and what a lookup found.

The enum's values are wire values: the ``x-cache`` header, the request log's ``cache_result``
column, the stats API and the dashboard all carry them, so they never change.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from gateway.error_control import ScopeLine
from gateway.tables import CacheEntry


class CacheResult(enum.StrEnum):
    EXACT_HIT = "exact-hit"
    SEMANTIC_HIT = "semantic-hit"
    MISS = "miss"  # looked up, not found: the backend answered
    BYPASS = "bypass"  # not looked up (cacheability, cache disabled): the backend answered


HITS = frozenset({CacheResult.EXACT_HIT, CacheResult.SEMANTIC_HIT})
NOT_HITS = frozenset({CacheResult.MISS, CacheResult.BYPASS})  # answered by a backend


@dataclass
class Lookup:
    """What the cache found. ``reason`` says why (the x-cache-reason header): ``exact`` and
    ``semantic`` for hits; for a miss, why the nearest candidate was refused: ``no-candidate`` (the
    scope holds nothing), ``below-threshold``, what kept the nearest stored answer from serving
    (``expired``, ``flagged``, ``too-old`` for the request's max-age, ``too-long`` for its max_tokens,
    ``truncated`` at another max_tokens, ``not-servable`` otherwise), ``entry-threshold`` (its own
    threshold, raised by feedback), what the alignment of the two queries found (``context-differs``:
    a document, quote or code around the question differs; ``guard:code``, ``guard:polarity``,
    ``guard:units``, ``guard:numbers`` and the verifier's other guards), ``verifier`` (the learned
    verifier said no to the differing part), ``error-bound`` (its score is under the line the scope's
    false-hit target allows, ``gateway/error_control.py``), or ``exact-only`` (no semantic lookup).

    ``score`` is what the serving decision thresholded on (the verifier's probability, or the cosine
    with the verifier off) for the hit, or for ``near``: the nearest candidate only the error-bound line
    refused (a near miss the audits may compare with the fresh answer)."""

    result: CacheResult  # EXACT_HIT, SEMANTIC_HIT or MISS
    entry: CacheEntry | None = None
    similarity: float | None = None  # of the hit, or of the nearest neighbour on a miss
    threshold: float | None = None
    embedding: np.ndarray | None = None
    embed_ms: float | None = None
    lookup_ms: float = 0.0
    reason: str = "no-candidate"
    score: float | None = None
    near: CacheEntry | None = None
    # the nearest candidate over the threshold that was refused, for whatever reason: its answer is
    # the backend's speculative-decoding draft (``gateway/drafts.py``)
    refused: CacheEntry | None = None
    scope_line: ScopeLine | None = None
