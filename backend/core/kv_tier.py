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
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from cachegw.backend.config import EngineConfig
from cachegw.backend.core.kv_disk import BlockFormat, DiskTier

if TYPE_CHECKING:
    from cachegw.backend.executor.model_runner import ModelRunner

TIERS = ("pool", "ram", "disk")
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


class KVOffload:
    """The RAM and disk tiers behind the pool. ``read_block``/``write_block`` move one block's K/V
    (every layer, shaped ``fmt.shape``) out of and into the pool."""

    def __init__(
        self,
        fmt: BlockFormat,
        read_block: Callable[[int], torch.Tensor],
        write_block: Callable[[int, torch.Tensor], None],
        ram_bytes: int,
        disk_dir: str = "",
        disk_bytes: int = 0,
    ) -> None:
        self.fmt = fmt
        self._read_block, self._write_block = read_block, write_block
        self.block_bytes = fmt.payload_bytes
        self.ram_budget = ram_bytes
        self.ram: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # oldest first
        self._pending: dict[bytes, torch.Tensor] = {}  # left RAM, not yet on disk
        self._prefetched: set[bytes] = set()  # in RAM because prefetch read them from disk
        self._lock = threading.Lock()
        self.disk = DiskTier(disk_dir, disk_bytes, fmt) if disk_dir else None
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="kv-tier") if self.disk else None
        self.load_latency = {"ram": LatencyHistogram(), "disk": LatencyHistogram()}

    @property
    def ram_bytes(self) -> int:
        return len(self.ram) * self.block_bytes

    def save(self, block_hash: bytes, block_id: int) -> None:
        """An evicted pool block: its K/V go to RAM (and what that pushes out, to disk)."""
        if self.ram_budget < self.block_bytes and self.disk is None:
            return
        self._put_ram(block_hash, self._read_block(block_id))

    def _put_ram(self, block_hash: bytes, data: torch.Tensor) -> None:
        spilled: list[tuple[bytes, torch.Tensor]] = []
        with self._lock:
            self.ram[block_hash] = data
            self.ram.move_to_end(block_hash)
            self._prefetched.discard(block_hash)
            while self.ram and len(self.ram) * self.block_bytes > self.ram_budget:
                spilled.append(self.ram.popitem(last=False))
                self._prefetched.discard(spilled[-1][0])
            if self.disk is not None:
                self._pending.update(spilled)
        if self._worker is not None:
            for h, d in spilled:
                self._worker.submit(self._write, h, d)

    def _write(self, block_hash: bytes, data: torch.Tensor) -> None:
        try:
            assert self.disk is not None
            self.disk.write(block_hash, data)
        finally:
            with self._lock:
                self._pending.pop(block_hash, None)

    def where(self, block_hash: bytes) -> str | None:
        """ "ram", "disk" or None: where a hash the pool misses can be loaded from."""
        with self._lock:
            if block_hash in self.ram or block_hash in self._pending:
                return "ram"
        if self.disk is not None and block_hash in self.disk:
            return "disk"
        return None

    def load(self, block_hash: bytes, block_id: int) -> str | None:
        """Copy a block's K/V into pool block ``block_id``; the tier it was found in ("disk" for a
        block prefetch read ahead), or None when it is gone or its file failed the checks (the caller
        then computes it)."""
        start = time.perf_counter()
        tier = "ram"
        with self._lock:
            data = self.ram.pop(block_hash, None)
            if block_hash in self._prefetched:
                tier = "disk"
                self._prefetched.discard(block_hash)
            if data is None:
                data = self._pending.get(block_hash)
        if data is None and self.disk is not None:
            tier, data = "disk", self.disk.read(block_hash)
        if data is None:
            return None
        self._write_block(block_id, data)
        self.load_latency[tier].observe(time.perf_counter() - start)
        return tier

    def prefetch(self, hashes: Iterable[bytes]) -> None:
        """Read these blocks from disk into RAM on the worker, ahead of their request's admission."""
        if self._worker is None or self.ram_budget < self.block_bytes:
            return
        for h in hashes:
            self._worker.submit(self._promote, h)

    def _promote(self, block_hash: bytes) -> None:
        with self._lock:
            if block_hash in self.ram or block_hash in self._pending:
                return
        assert self.disk is not None
        if block_hash in self.disk:
            data = self.disk.read(block_hash)
            if data is not None:
                self._put_ram(block_hash, data)
                with self._lock:
                    if block_hash in self.ram:
                        self._prefetched.add(block_hash)

    def persist(self, pool_blocks: Iterable[tuple[bytes, int]]) -> None:
        """At shutdown, what would otherwise be lost goes to disk: RAM (oldest first), then the pool's
        hashed blocks ``(hash, block id)``, so these are the most recent files."""
        if self._worker is None:
            return
        with self._lock:
            leaving = list(self.ram.items())
            self.ram.clear()
            self._pending.update(leaving)
        leaving += [(h, self._read_block(b)) for h, b in pool_blocks]
        for h, data in leaving:
            self._worker.submit(self._write, h, data)

    def flush(self) -> None:
        """Wait until every block on its way to disk is written (and every prefetch done)."""
        if self._worker is not None:
            self._worker.submit(lambda: None).result()

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None

    def stats(self) -> TierStats:
        with self._lock:
            ram_blocks = len(self.ram)
        disk_blocks, disk_bytes = (self.disk.num_blocks, self.disk.bytes) if self.disk else (0, 0)
        return TierStats(
            blocks={"ram": ram_blocks, "disk": disk_blocks},
            bytes={"ram": ram_blocks * self.block_bytes, "disk": disk_bytes},
            load_seconds={t: h.cumulative() for t, h in self.load_latency.items()},
            load_seconds_sum={t: h.total for t, h in self.load_latency.items()},
        )


def offload_for(
    cfg: EngineConfig, runner: ModelRunner, model_dir: Path, dtype: torch.dtype
) -> KVOffload | None:
    """The RAM/disk tier behind the runner's pool, when [engine] asks for one."""
    if not cfg.enable_prefix_caching or not (cfg.kv_offload_bytes or cfg.kv_offload_dir):
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
    return KVOffload(
        BlockFormat(identity, fmt.storage_dtype, shape),
        runner.read_block,
        runner.write_block,
        cfg.kv_offload_bytes,
        cfg.kv_offload_dir,
        cfg.kv_offload_disk_bytes,
    )
