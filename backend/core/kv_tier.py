"""A second KV tier: blocks evicted from the pool kept in host RAM, then on local disk.

The block manager hands over a hashed block when it evicts it (``save``); a prefix lookup that
misses the pool asks ``where`` a hash is and ``load``s it into a fresh pool block instead of
recomputing it. A block lives in one of pool or RAM (a load moves it out of RAM; an eviction moves
it back), and the disk tier keeps its file, since that copy is what survives a restart.

RAM is least recently used out; what leaves it goes to disk (``backend/core/kv_disk.py``) on a worker
thread, so the engine never waits for a write. Disk reads happen there too when they can: a request's
prompt blocks found only on disk are read into RAM when it arrives (``prefetch``), while it waits
and other sequences run, so its admission copies from memory.
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from cachegw.backend.config import EngineConfig
from cachegw.backend.core.kv_disk import BlockFormat, DiskTier
from cachegw.backend.core.kv_store import BlockStore

if TYPE_CHECKING:
    from cachegw.backend.core.kv_tier_events import TierEvents
    from cachegw.backend.executor.model_runner import ModelRunner

log = logging.getLogger("cachegw.backend")

TIERS = ("pool", "ram", "disk", "redis")
WRITE_BEHIND_QUEUE_BYTES = 256 << 20  # copies waiting for the worker; past it a block waits for shutdown
LOAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)


@dataclass
class LatencyHistogram:
    """Load times in seconds, bucketed as Prometheus' ``le`` buckets (thread-safe enough: one writer)."""

    buckets: tuple[float, ...] = LOAD_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * (len(LOAD_BUCKETS) + 1))
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, seconds)] += 1
        self.total += seconds

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, count)`` pairs up to ``+Inf``, the shape HistogramMetricFamily takes."""
        out, running = [], 0
        for le, n in zip([*map(str, self.buckets), "+Inf"], self.counts, strict=True):
            running += n
            out.append((le, running))
        return out


@dataclass(frozen=True)
class TierStats:
    """What each tier holds and how long loads from it took (the pool's entries added by the engine)."""

    blocks: dict[str, int]
    bytes: dict[str, int]
    load_seconds: dict[str, list[tuple[str, int]]]  # cumulative buckets, per tier loaded from
    load_seconds_sum: dict[str, float]
    errors: dict[str, int] = field(default_factory=dict)  # failed store operations, per store


class KVOffload:
    """The RAM tier and the stores behind it (disk, Redis). ``read_block``/``write_block`` move one
    block's K/V (every layer, shaped ``fmt.shape``) out of and into the pool."""

    def __init__(
        self,
        fmt: BlockFormat,
        read_block: Callable[[int], torch.Tensor],
        write_block: Callable[[int, torch.Tensor], None],
        ram_bytes: int,
        disk_dir: str = "",
        disk_bytes: int = 0,
        *,
        stores: Sequence[BlockStore] = (),
        write_behind: bool = False,
    ) -> None:
        self.fmt = fmt
        self._read_block, self._write_block = read_block, write_block
        self.block_bytes = fmt.payload_bytes
        self.ram_budget = ram_bytes
        self.ram: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # oldest first
        self._pending: dict[bytes, torch.Tensor] = {}  # left RAM, not yet in the stores
        self._prefetched: dict[bytes, str] = {}  # in RAM because prefetch read them: from which store
        self._lock = threading.Lock()
        self.disk = DiskTier(disk_dir, disk_bytes, fmt) if disk_dir else None
        self.stores: list[BlockStore] = [*([self.disk] if self.disk else []), *stores]
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="kv-tier") if self.stores else None
        self.write_behind = write_behind and bool(self.stores)
        self._deadline = math.inf  # when persist's shutdown budget ends
        self._behind_bytes = 0  # copies queued for write-behind, not yet stored
        self.behind_skipped = 0  # blocks not written behind: the queue was full (shutdown writes them)
        names = ["ram", "disk", *(s.name for s in self.stores)]
        self.load_latency = {n: LatencyHistogram() for n in names}
        self.events: TierEvents | None = None  # each move as a KV event, once attached

    def attach_events(self, events: TierEvents) -> None:
        """Publish every move from now on, and (on the worker) what the stores hold already."""
        self.events = events
        for store in self.stores:
            store.events = events
            if self._worker is not None:
                self._worker.submit(events.announce, store.name, store.held())

    @property
    def ram_bytes(self) -> int:
        return len(self.ram) * self.block_bytes

    def save(self, block_hash: bytes, block_id: int) -> None:
        """An evicted pool block: its K/V go to RAM (and what that pushes out, to the stores)."""
        if self.ram_budget < self.block_bytes and not self.stores:
            return
        self._put_ram(block_hash, self._read_block(block_id))

    def _put_ram(self, block_hash: bytes, data: torch.Tensor) -> None:
        spilled: list[tuple[bytes, torch.Tensor]] = []
        with self._lock:
            self.ram[block_hash] = data
            self.ram.move_to_end(block_hash)
            self._prefetched.pop(block_hash, None)
            while self.ram and len(self.ram) * self.block_bytes > self.ram_budget:
                spilled.append(self.ram.popitem(last=False))
                self._prefetched.pop(spilled[-1][0], None)
            if self.stores:
                self._pending.update(spilled)
            kept = block_hash in self.ram
        if self.events is not None:
            self.events.stored("ram", [block_hash] if kept else [])
            if not self.stores:  # dropped, not spilled
                self.events.removed("ram", [h for h, _ in spilled])
        if self._worker is not None:
            for h, d in spilled:
                self._worker.submit(self._write, h, d)

    def _write(self, block_hash: bytes, data: torch.Tensor) -> None:
        try:
            self._store(block_hash, data)
        finally:
            with self._lock:
                self._pending.pop(block_hash, None)
                gone = block_hash not in self.ram
            if self.events is not None and gone:
                self.events.removed("ram", [block_hash])

    def _store(self, block_hash: bytes, data: torch.Tensor, mtime: float | None = None) -> None:
        for store in self.stores:
            store.write(block_hash, data, mtime)

    def filled(self, block_hash: bytes, block_id: int) -> None:
        """A pool block just computed and hashed. With write-behind, a copy goes to the stores on the
        worker, so a killed engine loses little; the copy is taken here, on the engine thread, since
        the pool block may be reused before the worker gets to it."""
        if not self.write_behind or self._worker is None:
            return
        with self._lock:
            if self._behind_bytes + self.block_bytes > WRITE_BEHIND_QUEUE_BYTES:
                self.behind_skipped += 1
                return
            self._behind_bytes += self.block_bytes
        self._worker.submit(self._write_behind, block_hash, self._read_block(block_id))

    def _write_behind(self, block_hash: bytes, data: torch.Tensor) -> None:
        try:
            self._store(block_hash, data)
        finally:
            with self._lock:
                self._behind_bytes -= self.block_bytes

    def where(self, block_hash: bytes) -> str | None:
        """ "ram", a store's name or None: where a hash the pool misses can be loaded from."""
        with self._lock:
            if block_hash in self.ram or block_hash in self._pending:
                return "ram"
        return next((s.name for s in self.stores if block_hash in s), None)

    def ram_copy(self, block_hash: bytes) -> torch.Tensor | None:
        """The block's K/V if RAM holds it or it is on its way to the stores (left as it is)."""
        with self._lock:
            data = self.ram.get(block_hash)
            return self._pending.get(block_hash) if data is None else data

    def load(self, block_hash: bytes, block_id: int) -> str | None:
        """Copy a block's K/V into pool block ``block_id``; the tier it was found in (a store's name
        for a block prefetch read ahead), or None when it is gone or failed the checks (the caller
        then computes it)."""
        start = time.perf_counter()
        tier = "ram"
        with self._lock:
            data = self.ram.pop(block_hash, None)
            tier = self._prefetched.pop(block_hash, tier)
            moved = data is not None
            if data is None:
                data = self._pending.get(block_hash)
        if moved and self.events is not None:
            self.events.removed("ram", [block_hash])
        for store in self.stores if data is None else ():
            tier, data = store.name, store.read(block_hash)
            if data is not None:
                break
        if data is None:
            return None
        self._write_block(block_id, data)
        self.load_latency[tier].observe(time.perf_counter() - start)
        return tier

    def prefetch(self, hashes: Iterable[bytes]) -> None:
        """Read these blocks from the stores into RAM on the worker, ahead of their request's admission."""
        if self._worker is None or self.ram_budget < self.block_bytes:
            return
        for h in hashes:
            self._worker.submit(self._promote, h)

    def _promote(self, block_hash: bytes) -> None:
        with self._lock:
            if block_hash in self.ram or block_hash in self._pending:
                return
        for store in self.stores:
            data = store.read(block_hash) if block_hash in store else None
            if data is not None:
                self._put_ram(block_hash, data)
                with self._lock:
                    if block_hash in self.ram:
                        self._prefetched[block_hash] = store.name
                return

    def persist(self, pool_blocks: Iterable[tuple[bytes, int]], budget_s: float = math.inf) -> int:
        """At shutdown, what would otherwise be lost goes to the stores, most recently used first, for
        at most ``budget_s``: the pool's hashed blocks ``(hash, block id)`` in the order given (most
        recent first), then RAM's, newest first. Each file is stamped a little older than the one
        before, so the next start ranks them as they were used. Returns the blocks written; call
        ``close`` after it (it waits for earlier spills within what is left of the budget)."""
        self._deadline = time.monotonic() + budget_s
        if self._worker is None:
            return 0
        with self._lock:
            ram = list(reversed(self.ram.items()))
            self.ram.clear()
            self._prefetched.clear()
        now, written = time.time(), 0
        sources: list[tuple[bytes, int | torch.Tensor]] = [*pool_blocks, *ram]
        for rank, (h, src) in enumerate(sources):
            if time.monotonic() >= self._deadline:
                log.warning("KV tier: shutdown budget spent, %d blocks not written", len(sources) - rank)
                break
            if all(h in s for s in self.stores):
                continue
            self._store(h, self._read_block(src) if isinstance(src, int) else src, now - rank * 1e-4)
            written += 1
        return written

    def flush(self) -> None:
        """Wait until every block on its way to the stores is written (and every prefetch done)."""
        if self._worker is not None:
            self._worker.submit(lambda: None).result()

    def close(self) -> None:
        """Finish the queued writes (within what is left of ``persist``'s budget), then release."""
        if self._worker is not None:
            left = self._deadline - time.monotonic()
            try:
                self._worker.submit(lambda: None).result(timeout=max(left, 0) if left < math.inf else None)
            except FuturesTimeout:
                log.warning("KV tier: shutdown budget spent before the queued writes finished")
            self._worker.shutdown(wait=False, cancel_futures=True)
            self._worker = None
        for store in self.stores:
            store.close()

    def stats(self) -> TierStats:
        with self._lock:
            ram_blocks = len(self.ram)
        blocks, size = {"ram": ram_blocks, "disk": 0}, {"ram": ram_blocks * self.block_bytes, "disk": 0}
        for s in self.stores:
            blocks[s.name], size[s.name] = s.num_blocks, s.bytes
        return TierStats(
            blocks=blocks,
            bytes=size,
            load_seconds={t: h.cumulative() for t, h in self.load_latency.items()},
            load_seconds_sum={t: h.total for t, h in self.load_latency.items()},
            errors={s.name: s.errors for s in self.stores},
        )


def offload_for(
    cfg: EngineConfig, runner: ModelRunner, model_dir: Path, dtype: torch.dtype
) -> KVOffload | None:
    """The RAM tier and its stores (disk, Redis) behind the runner's pool, when [engine] asks for one."""
    if not cfg.enable_prefix_caching or not (
        cfg.kv_offload_bytes or cfg.kv_offload_dir or cfg.kv_offload_url
    ):
        return None
    spec = runner.spec
    # Whatever changes the K/V of a token: the weights (where they are, how quantized) and the dtype.
    identity = f"{model_dir.resolve()}|{cfg.load_format}|{runner.quantization}"
    if cfg.load_format == "dummy":
        identity += f"|seed={cfg.seed}"
    fmt = runner.kv_format
    if fmt.kind != "auto":  # int8/fp8 blocks (scales included) computed in this compute dtype
        identity += f"|kv={fmt.kind}|{str(dtype).removeprefix('torch.')}"
    shape = (spec.num_layers, spec.kv_parts, cfg.block_size, spec.num_kv_heads, fmt.row_width)
    block_format = BlockFormat(identity, fmt.storage_dtype, shape)
    stores: list[BlockStore] = []
    if cfg.kv_offload_url:
        from cachegw.backend.core.kv_redis import RedisTier

        stores.append(RedisTier(cfg.kv_offload_url, block_format, cfg.kv_offload_url_ttl_s))
    return KVOffload(
        block_format,
        runner.read_block,
        runner.write_block,
        cfg.kv_offload_bytes,
        cfg.kv_offload_dir,
        cfg.kv_offload_disk_bytes,
        stores=stores,
        write_behind=cfg.kv_write_behind,
    )
