"""Pins: prompt prefixes a client said will come back, held in the KV cache for a while.

A request may ask to pin the first ``tokens`` of its prompt for ``ttl`` seconds (``PinRequest``; the
server derives them from ``cache_pins`` and ``prompt_cache_retention``). Once the prompt is computed,
each full block of that prefix gets one reference from the pin table, so the pool never evicts it,
however many other prompts want blocks. Pins are kept per block and keyed by the block's chained hash
(which names the whole prefix up to it, salt included): pinning a prefix again renews its blocks'
expiry instead of adding references, and two pins sharing a prefix share its blocks. A block's expiry
is the latest of the pins covering it, so a prefix's earlier blocks never expire before its later ones.

Pool pins may hold at most ``max_blocks`` blocks (``[engine] pinned_kv_share`` of the pool); a pin is
refused for the blocks past that, and for everything after its first block the pool no longer holds.
A ``spill`` pin (OpenAI's ``prompt_cache_retention: "24h"``) holds no pool block when a RAM/disk tier
exists: its blocks are recorded (and reported) as pinned, and when the pool evicts them they move to
the tier as any hashed block does, which keeps them within its budgets, least recently used out.

Expired pins are released lazily, at the start of each scheduling step (``expire``; the clock is
injectable for tests). Pins never deadlock the engine: when nothing runs and the first waiting request
cannot get its blocks, the scheduler takes back pinned blocks, soonest expiry first (``yield_block``).
Pins hold references of their own, so preempting or aborting a request never touches them.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cachegw.backend.core.block_manager import BlockManager
    from cachegw.backend.core.sequence import Sequence


@dataclass(frozen=True)
class PinRequest:
    """Keep the prompt's first ``tokens`` (rounded down to whole blocks) cached for ``ttl`` seconds."""

    tokens: int
    ttl: float
    spill: bool = False  # may live in the RAM/disk tier rather than hold pool blocks

    def __post_init__(self) -> None:
        if not isinstance(self.tokens, int) or self.tokens < 0:
            raise ValueError("a pin's tokens must be an integer >= 0")
        if not (self.ttl > 0 and math.isfinite(self.ttl)):
            raise ValueError("a pin's ttl must be a positive number of seconds")


@dataclass(slots=True)
class _Pin:
    block_id: int | None  # the pool block it holds a reference on; None for a tier (spill) pin
    expires_at: float
    depth: int  # the block's index in its prefix: deeper blocks go first when expiries tie


class PinTable:
    """The pinned blocks of one block manager, by chained block hash."""

    def __init__(
        self, block_manager: BlockManager, max_blocks: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.bm = block_manager
        self.max_blocks = max_blocks
        self.clock = clock
        self.pins: dict[bytes, _Pin] = {}
        self._heap: list[tuple[float, int, bytes]] = []  # (expires_at, -depth, hash); stale ones skipped
        self.num_pool_blocks = 0  # pins holding a pool block (what max_blocks bounds)
        self.released_early = 0  # pool pins taken back so a request could run

    @property
    def num_blocks(self) -> int:
        return len(self.pins)

    @property
    def num_tier_blocks(self) -> int:
        return len(self.pins) - self.num_pool_blocks

    def on_computed(self, seq: Sequence) -> None:
        """Apply the seq's pins once its whole prompt is computed (and its blocks findable)."""
        done = seq.num_computed_tokens >= seq.num_prompt_tokens
        if seq.num_pinned_tokens >= 0 or not seq.params.pins or not done:
            return
        seq.num_pinned_tokens = self.pin(seq, seq.params.pins)

    def pin(self, seq: Sequence, requests: tuple[PinRequest, ...]) -> int:
        """Pin (or renew) the seq's prompt prefixes; returns the prompt tokens now held by pins."""
        bm = self.bm
        if not bm.enable_prefix_caching:
            return 0
        now, bs = self.clock(), bm.block_size
        spill_ok = bm.tier is not None  # without a tier, a spill pin is an ordinary one
        held = 0
        for spill in (False, True):
            wanted = [r for r in requests if (r.spill and spill_ok) == spill]
            ends = [(min(r.tokens, seq.num_prompt_tokens) // bs, r.ttl) for r in wanted]
            n = max((e for e, _ in ends), default=0)
            for i in range(n):
                expires_at = now + max(ttl for e, ttl in ends if e > i)
                if not self._pin_block(bm.block_hash(seq, i), i, expires_at, spill):
                    break
                held = max(held, (i + 1) * bs)
        return held

    def _pin_block(self, block_hash: bytes, depth: int, expires_at: float, spill: bool) -> bool:
        """Pin one block or renew its pin; False if it cannot be (not findable, or over the cap)."""
        pin = self.pins.get(block_hash)
        if pin is not None and (pin.block_id is not None or spill):
            if expires_at > pin.expires_at:
                pin.expires_at = expires_at
                heapq.heappush(self._heap, (expires_at, -depth, block_hash))
            return True
        if spill:
            self.pins[block_hash] = _Pin(None, expires_at, depth)
        else:  # a new pool pin, or a tier pin becoming one
            if self.num_pool_blocks >= self.max_blocks:
                return False
            block_id = self.bm.hold(block_hash)
            if block_id is None:
                return False
            self.num_pool_blocks += 1
            expires_at = max(expires_at, pin.expires_at) if pin is not None else expires_at
            self.pins[block_hash] = _Pin(block_id, expires_at, depth)
        heapq.heappush(self._heap, (expires_at, -depth, block_hash))
        return True

    def expire(self) -> int:
        """Release every pin whose time is up; returns how many blocks it let go."""
        now, released = self.clock(), 0
        while self._heap and self._heap[0][0] <= now:
            if self._pop_live() is not None:
                released += 1
        return released

    def yield_block(self) -> bool:
        """Take back the pool pin expiring soonest (deepest first); False when no pool pin is left.
        A scan, not the heap: it runs only when the engine would otherwise stall."""
        pool = [(p.expires_at, -p.depth, h) for h, p in self.pins.items() if p.block_id is not None]
        if not pool:
            return False
        block_hash = min(pool)[2]
        self._release(self.pins.pop(block_hash))  # its heap entries go stale
        self.released_early += 1
        return True

    def _pop_live(self) -> _Pin | None:
        """Pop the heap's first entry and release its pin if the entry is current (else None)."""
        expires_at, _, block_hash = heapq.heappop(self._heap)
        pin = self.pins.get(block_hash)
        if pin is None or pin.expires_at != expires_at:
            return None  # renewed (a later entry stands for it) or already released
        del self.pins[block_hash]
        self._release(pin)
        return pin

    def _release(self, pin: _Pin) -> None:
        if pin.block_id is not None:
            self.num_pool_blocks -= 1
            self.bm.release(pin.block_id)

    def release_all(self) -> int:
        """Drop every pin (their blocks become evictable); returns how many there were."""
        n = len(self.pins)
        for pin in self.pins.values():
            if pin.block_id is not None:
                self.bm.release(pin.block_id)
        self.pins.clear()
        self._heap.clear()
        self.num_pool_blocks = 0
        return n
