"""Heavy-Hitter Oracle KV eviction (``[engine] kv_eviction = "h2o"``, arXiv 2306.14048).

Each step the attention path reports how much attention every cached key received (summed over
layers, heads and the step's queries: ``layers/scored_attention.py``); a sequence adds it to its
``key_scores``. Once a sequence holds a whole block more than ``kv_budget_tokens``, it keeps
``budget`` slots: the first ``sinks`` (``attention_sinks``: always kept), the ``recent`` most recent
ones, and, of the rest, those with the highest accumulated attention; the others are dropped. The
kept K/V rows are moved, in order, to the front of its first blocks (compaction), the blocks after
them go back to the pool, so a sequence never holds more than budget + one block (+ a prefill
chunk) of KV. Keys keep the rotary positions they were written with and new tokens go on counting
positions (``Sequence.kv_dropped`` maps a position to its slot). One ranking serves every layer and
head, as the block table is the sequence's, not a layer's. Compacted blocks are unhashed and a
sequence with dropped tokens hashes nothing more: its blocks no longer hold the prefix a hash names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from cachegw.backend.core.block_manager import BlockManager
from cachegw.backend.core.sequence import Sequence

if TYPE_CHECKING:
    from cachegw.backend.config import EngineConfig


class H2OEviction:
    """Scores in, compaction out. ``move_rows(src, dst)`` copies cache rows (flat slots) in every
    layer, reading all sources before writing (``ModelRunner.move_rows``)."""

    def __init__(
        self,
        block_manager: BlockManager,
        move_rows: Callable[[torch.Tensor, torch.Tensor], None],
        budget: int,
        recent: int,
        sinks: int = 0,
    ) -> None:
        self.bm = block_manager
        self.move_rows = move_rows
        self.budget, self.recent, self.sinks = budget, recent, sinks
        self.evictions = 0  # compactions done
        self.dropped_tokens = 0

    def after_step(self, seqs: list[Sequence], key_mass: torch.Tensor | None) -> None:
        """Add the step's attention to each sequence's scores, then compact those over the budget.
        Call once the step's tokens count as computed."""
        if key_mass is None:
            return
        mass = key_mass.float().cpu()
        for i, seq in enumerate(seqs):
            slots = seq.num_cached_slots
            scores = seq.key_scores if seq.key_scores is not None else torch.zeros(0)
            if len(scores) < slots:
                scores = torch.cat((scores, torch.zeros(slots - len(scores))))
            seq.key_scores = scores[:slots] + mass[i, :slots]
            if slots - self.budget >= self.bm.block_size:
                self._compact(seq)

    def keep(self, scores: torch.Tensor) -> torch.Tensor:
        """The slots kept (ascending) out of ``len(scores)``: sinks, heavy hitters, recent window."""
        n = len(scores)
        recent_from = n - self.recent
        middle = scores[self.sinks : recent_from]
        heavy = self.budget - self.sinks - self.recent
        top = (
            torch.topk(middle, heavy).indices + self.sinks if heavy > 0 else torch.zeros(0, dtype=torch.long)
        )
        return torch.cat((torch.arange(self.sinks), top.sort().values, torch.arange(recent_from, n)))

    def _compact(self, seq: Sequence) -> None:
        assert seq.key_scores is not None
        kept = self.keep(seq.key_scores)
        bs, old = self.bm.block_size, list(seq.block_table)
        table = self.bm.compact(seq, len(kept))
        if table is None:  # no block for a copy-on-write: try again next step
            return
        src = torch.tensor([old[k // bs] * bs + k % bs for k in kept.tolist()])
        dst = torch.tensor([table[i // bs] * bs + i % bs for i in range(len(kept))])
        moved = src != dst
        if bool(moved.any()):
            self.move_rows(src[moved], dst[moved])
        dropped = len(seq.key_scores) - len(kept)
        seq.kv_dropped += dropped
        seq.key_scores = seq.key_scores[kept]
        self.evictions += 1
        self.dropped_tokens += dropped


def check_h2o(config: EngineConfig, windows: tuple[int | None, ...], softcapped: bool = False) -> None:
    """Refuse, at start, what H2O cannot honour on this model rather than ignore the setting (what
    the settings alone rule out, ``EngineConfig`` refuses)."""
    if config.kv_eviction == "h2o" and softcapped:
        raise ValueError(
            'kv_eviction = "h2o" with soft-capped attention (Gemma 2): its scored path does not cap'
        )
    if config.kv_eviction == "h2o" and any(w is not None for w in windows):
        raise ValueError(
            'kv_eviction = "h2o" with a sliding-window model: the window counts positions, which '
            "compaction no longer maps to slots; use one or the other"
        )


def h2o_for(
    config: EngineConfig, block_manager: BlockManager, move_rows: Callable[[torch.Tensor, torch.Tensor], None]
) -> H2OEviction | None:
    """The evictor ``[engine] kv_eviction`` asks for (None: keep every token's K/V)."""
    if config.kv_eviction != "h2o":
        return None
    budget = config.kv_budget_tokens
    recent = config.kv_recent_tokens or (budget - config.attention_sinks) // 2
    return H2OEviction(block_manager, move_rows, budget, recent, config.attention_sinks)
