"""What a cache lookup found (the results a request can have are ``CacheResult``, in the request log's
record)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cachegw.gateway.cache.error_control import ScopeLine
from cachegw.gateway.storage.request_record import CacheResult
from cachegw.gateway.storage.tables import CacheEntry


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
    false-hit target allows, ``gateway/cache/error_control.py``), or ``exact-only`` (no semantic lookup).

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
    # the backend's speculative-decoding draft (``Flow.draft``, gateway/request/flow.py)
    refused: CacheEntry | None = None
    scope_line: ScopeLine | None = None
