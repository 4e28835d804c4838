"""Swap preemption (``[engine] preemption_mode``): a preempted sequence's K/V wait in host memory.

Under ``recompute`` (the default) a preempted sequence drops its blocks and computes its tokens
again when it resumes (its full blocks usually still in the prefix cache). Under ``swap`` every block
it computed, the partly filled last one and blocks without a hash included, is copied to host memory
(``ModelRunner.read_block``) before its blocks are freed, and copied into fresh pool blocks when it
is admitted again: its block table is rebuilt and not one token is recomputed. ``auto`` swaps a
sequence only when it has at least ``swap_min_tokens`` computed tokens, the crossover measured by
``bench/preemption.py`` (docs/benchmarks.md): below it recomputing is as cheap as the copies. On a CPU
there is none (a block's copy costs less than recomputing one token in a running batch), so the
default, 1, swaps every preempted sequence; a device where recompute is cheap next to the copies
raises it.

Swapped data is bounded by ``swap_space_bytes``; a sequence that does not fit falls back to
recompute, counted in ``fallbacks``. Entries a sliding window freed (``FREED``) stay freed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from cachegw.backend.core.block_manager import FREED, BlockManager, cdiv
from cachegw.backend.core.sequence import Sequence

if TYPE_CHECKING:
    from cachegw.backend.config import EngineConfig

PreemptionMode = Literal["recompute", "swap", "auto"]


@dataclass
class Swapped:
    """One swapped-out sequence: its table layout and the K/V of each block that held any."""

    table: list[int]  # FREED entries stay FREED; others are replaced by fresh blocks on resume
    data: list[torch.Tensor]  # one per non-FREED entry, in table order
    num_computed_tokens: int
    nbytes: int
    kv_dropped: int = 0  # H2O's state: what it dropped, and the attention each kept slot received
    key_scores: torch.Tensor | None = None


@dataclass
class SwapCounts:
    """What swapping did: sequences swapped out and back in, and those that were recomputed instead
    because the swap space was full."""

    swapped_out: int = 0
    swapped_in: int = 0
    fallbacks: int = 0
    bytes_held: int = 0


class SwapSpace:
    """Host copies of preempted sequences' blocks; ``read_block``/``write_block`` move one block's
    K/V (every layer) out of and into the pool."""

    def __init__(
        self,
        block_manager: BlockManager,
        read_block: Callable[[int], torch.Tensor],
        write_block: Callable[[int, torch.Tensor], None],
        mode: PreemptionMode,
        budget_bytes: int,
        min_tokens: int = 0,
    ) -> None:
        self.bm = block_manager
        self._read, self._write = read_block, write_block
        self.mode = mode
        self.budget_bytes = budget_bytes
        self.min_tokens = min_tokens
        self.held: dict[Sequence, Swapped] = {}
        self.counts = SwapCounts()

    def wants(self, seq: Sequence) -> bool:
        """Swap this sequence rather than recompute it? (``auto``: long enough to be worth it.)"""
        if seq.num_computed_tokens == 0:
            return False
        return self.mode == "swap" or (self.mode == "auto" and seq.num_computed_tokens >= self.min_tokens)

    def swap_out(self, seq: Sequence) -> bool:
        """Copy the seq's computed blocks to host memory (call before its blocks are freed); False
        when it is to be recomputed instead."""
        if not self.wants(seq):
            return False
        table = seq.block_table[: cdiv(seq.num_cached_slots, self.bm.block_size)]
        live = [b for b in table if b != FREED]
        if not live:
            return False
        data = [self._read(b) for b in live]
        nbytes = sum(d.numel() * d.element_size() for d in data)
        if self.counts.bytes_held + nbytes > self.budget_bytes:
            self.counts.fallbacks += 1
            return False
        self.held[seq] = Swapped(
            list(table), data, seq.num_computed_tokens, nbytes, seq.kv_dropped, seq.key_scores
        )
        self.counts.swapped_out += 1
        self.counts.bytes_held += nbytes
        return True

    def holds(self, seq: Sequence) -> bool:
        return seq in self.held

    def resume(self, seq: Sequence, budget: int) -> int | None:
        """Admit a swapped-out seq: its blocks copied into fresh pool blocks, then slots for its next
        chunk (at most ``budget`` tokens). Returns that chunk's size, or None (it stays swapped) when
        the pool lacks the blocks."""
        sw = self.held[seq]
        bs = self.bm.block_size
        n = min(seq.num_tokens - sw.num_computed_tokens, budget)
        more = max(0, cdiv(sw.num_computed_tokens - sw.kv_dropped + n, bs) - len(sw.table))
        if len(sw.data) + more > self.bm.num_free_blocks:
            return None
        fresh = iter(self.bm.take_blocks(len(sw.data)))
        seq.block_table = [FREED if b == FREED else next(fresh) for b in sw.table]
        for block_id, data in zip((b for b in seq.block_table if b != FREED), sw.data, strict=True):
            self._write(block_id, data)
        seq.num_computed_tokens = sw.num_computed_tokens
        seq.kv_dropped, seq.key_scores = sw.kv_dropped, sw.key_scores
        self.bm.append_slots(seq, n)
        self.drop(seq)
        self.counts.swapped_in += 1
        return n

    def drop(self, seq: Sequence) -> None:
        """Forget a seq's swapped blocks (resumed, finished or aborted)."""
        sw = self.held.pop(seq, None)
        if sw is not None:
            self.counts.bytes_held -= sw.nbytes


def swap_space_for(
    config: EngineConfig,
    block_manager: BlockManager,
    read_block: Callable[[int], torch.Tensor],
    write_block: Callable[[int, torch.Tensor], None],
) -> SwapSpace | None:
    """The swap space ``[engine] preemption_mode`` asks for (None under ``recompute``)."""
    if config.preemption_mode == "recompute":
        return None
    return SwapSpace(
        block_manager,
        read_block,
        write_block,
        config.preemption_mode,
        config.swap_space_bytes,
        config.swap_min_tokens,
    )
