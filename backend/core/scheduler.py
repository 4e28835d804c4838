"""Continuous batching: which sequences run in the next step, and how many tokens each.

Every step has a token budget (``max_num_batched_tokens``). Running sequences go first: a
decode takes one token (plus its draft tokens with speculative decoding), an unfinished prompt
takes the next chunk. When blocks run out, drafts are dropped first, then the running sequence
that is last in the order below is preempted (its blocks freed, to be recomputed later, likely
from the prefix cache, or under ``[engine] preemption_mode`` swap copied to host memory and back:
``backend/core/swap.py``) until the earlier one fits. Waiting sequences then join in that order
while budget, ``max_num_seqs`` and blocks allow. A sequence is always in exactly one of
``waiting`` or ``running`` until it finishes, so none is lost or run twice.

The order: vLLM's ``priority`` (lower first, 0 by default; the gateway's audits ask for a higher
value), aged by arrival: ``priority * aging + arrival``, so each ``aging`` seconds of waiting is worth
one priority level. With every priority equal it is arrival order: the newest is preempted, the
oldest admitted. A sequence's key never changes, and only those with a smaller key can run ahead of
it or preempt it: none that arrived more than ``(its priority + MAX_PRIORITY) * aging`` seconds after
it (``MAX_PRIORITY`` bounds priorities), so that is a finite set and nothing starves, waiting or
preempted over and over. ``waiting`` is sorted on insertion; ``running`` (at most
``max_num_seqs``) at each step. Unlike vLLM's priority policy, a waiting request never preempts a
running one to get in: it waits for one to finish, or to be preempted when a running one needs blocks.

Pinned prefixes (``backend/core/pins.py``) hold blocks of their own: expired pins are released at the
start of each step, and when nothing runs and the first waiting sequence still cannot get its blocks,
pinned blocks are taken back one at a time until it can, so pins never stall the engine.
"""

from __future__ import annotations

import time
from bisect import insort_left, insort_right
from collections import deque
from dataclasses import dataclass, field

from cachegw.backend.core.block_manager import BlockManager
from cachegw.backend.core.pins import PinTable
from cachegw.backend.core.sequence import Sequence, SequenceStatus
from cachegw.backend.core.swap import SwapSpace

PRIORITY_AGING_S = 1.0  # seconds of waiting worth one priority level


@dataclass
class ScheduledBatch:
    """Sequences of one step, those with a single query token first, and their token counts."""

    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    num_preempted: int = 0

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        priority_aging_s: float = PRIORITY_AGING_S,
        speculative_max_seqs: int = 1,
        pins: PinTable | None = None,
        swap: SwapSpace | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.swap = swap  # [engine] preemption_mode swap/auto: preempted K/V wait in host memory
        self.pins = pins
        self.priority_aging_s = priority_aging_s
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.speculative_max_seqs = speculative_max_seqs  # drafts only while at most this many run
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def _order_key(self, seq: Sequence) -> float:
        return seq.params.priority * self.priority_aging_s + seq.arrival_time

    def add(self, seq: Sequence) -> None:
        """Queue behind every waiting sequence with the same key or a better one."""
        insort_right(self.waiting, seq, key=self._order_key)

    def has_room(self) -> bool:
        return len(self.running) < self.max_num_seqs

    def add_running(self, seq: Sequence) -> None:
        """A forked sample whose blocks are already in place: it decodes from the next step."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        if self.pins is not None:
            self.pins.expire()
        budget = self.max_num_batched_tokens
        picked: list[tuple[Sequence, int]] = []
        preempted = 0
        self.running.sort(key=self._order_key)  # the last is the first preempted
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            draft = self._draft(seq, n, budget)
            while not self.block_manager.can_append(seq, n + len(draft)):
                if draft:  # drafts are a guess: drop them before preempting anyone
                    draft = []
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                preempted += 1
                if victim is seq:
                    break
            else:
                seq.draft = draft
                n += len(draft)
                self.block_manager.append_slots(seq, n)
                picked.append((seq, n))
                budget -= n
                i += 1
                continue
            break  # seq itself was preempted: nothing after it is left running
        if not preempted:
            self._admit_waiting(picked, budget)
        # Single-token queries first, shortest context first: attention pads each group of them
        # to its longest context, so neighbours of similar length waste the least.
        picked.sort(key=lambda p: (p[1] != 1, p[0].num_computed_tokens if p[1] == 1 else 0))
        return ScheduledBatch([s for s, _ in picked], [n for _, n in picked], preempted)

    def _draft(self, seq: Sequence, n: int, budget: int) -> list[int]:
        """Draft tokens to verify with a decode (``backend/core/speculative.py``): never more than the
        step's budget or the request's max_tokens leave room for beside the model's own token, and
        none in a larger batch (it already reads each weight once for many tokens, and a drafted
        sequence leaves the batched decode attention)."""
        if seq.spec is None or n != 1 or not seq.num_output_tokens:
            return []
        if len(self.running) > self.speculative_max_seqs:
            return []
        room = min(budget, seq.params.max_tokens - seq.num_output_tokens) - 1
        return seq.spec.propose(seq.token_ids, seq.num_prompt_tokens, room)

    def _admit_waiting(self, picked: list[tuple[Sequence, int]], budget: int) -> None:
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self.swap is not None and self.swap.holds(seq):
                resumed = self.swap.resume(seq, budget)  # its blocks copied back: nothing recomputed
                while (
                    resumed is None and not self.running and self.pins is not None and self.pins.yield_block()
                ):
                    resumed = self.swap.resume(seq, budget)  # with nothing running, pins give way
                if resumed is None:
                    break
                n = resumed
            else:
                cached = bm.find_cached_prefix(seq)
                n = min(seq.num_tokens - len(cached) * bm.block_size, budget)
                if not self._room_for(seq, cached, n):
                    break
                bm.allocate(seq, cached, n)  # counts the prefix-cache hit (per tier) on first admission
            if seq.num_cached_tokens < 0:  # first time: this is the request's prefix-cache hit
                seq.num_cached_tokens = seq.num_computed_tokens
                seq.first_scheduled_time = time.time()
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            picked.append((seq, n))
            budget -= n

    def _room_for(self, seq: Sequence, cached: list[int], n: int) -> bool:
        """Can ``seq`` start now? With nothing running, pins give back blocks until it can."""
        while not self.block_manager.can_allocate(seq, cached, n):
            if self.running or self.pins is None or not self.pins.yield_block():
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        if self.swap is not None:
            self.swap.swap_out(seq)  # or recomputed, as without swap
        self.block_manager.free_blocks(seq)
        seq.draft = []
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        insort_left(self.waiting, seq, key=self._order_key)  # ahead of its equals: it ran first

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence wherever it is and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
            if self.swap is not None:
                self.swap.drop(seq)
        self.block_manager.free_blocks(seq)
        seq.status = SequenceStatus.FINISHED
