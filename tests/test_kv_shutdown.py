"""What the KV tier does at shutdown and around it, without a model: the pool's and RAM's blocks written
most recently used first within a budget (and ranked that way by the next start), write-behind, and a
Redis that hangs costing a bounded wait, then nothing."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from cachegw.backend.core.block_manager import BlockManager
from cachegw.backend.core.kv_disk import BlockFormat, DiskTier
from cachegw.backend.core.kv_tier import KVOffload
from cachegw.backend.core.sampling_params import SamplingParams
from cachegw.backend.core.sequence import Sequence

BS = 4
SHAPE = (1, 2, BS, 1, 2)
FMT = BlockFormat("tiny-model", torch.float32, SHAPE)


def hashes(n: int) -> list[bytes]:
    return [bytes([i]) * 32 for i in range(n)]


def offload(tmp_path, ram_blocks: int = 0, **kw) -> tuple[KVOffload, torch.Tensor]:
    kv = torch.zeros((8, *SHAPE))  # the pool: block b holds b everywhere
    for b in range(8):
        kv[b].fill_(float(b))

    def read(b: int) -> torch.Tensor:
        return kv[b].clone()

    def write(b: int, data: torch.Tensor) -> None:
        kv[b].copy_(data)

    return KVOffload(FMT, read, write, ram_blocks * FMT.payload_bytes, str(tmp_path), 1 << 30, **kw), kv


def test_shutdown_writes_most_recent_first_and_the_next_start_ranks_them_so(tmp_path):
    tier, _ = offload(tmp_path, ram_blocks=2)
    h = hashes(6)
    tier.save(h[4], 4)  # RAM: h4 older than h5
    tier.save(h[5], 5)
    assert tier.persist([(h[0], 0), (h[1], 1), (h[2], 2)]) == 5  # pool, most recent first
    tier.close()
    scanned = DiskTier(tmp_path, 1 << 30, FMT)
    oldest_first = list(scanned._files)
    assert oldest_first == [h[4], h[5], h[2], h[1], h[0]]  # RAM's before the pool's, newest last
    assert torch.equal(scanned.read(h[1]), torch.full(SHAPE, 1.0))


def test_a_spent_budget_stops_the_writes_and_a_small_one_keeps_the_most_recent(tmp_path):
    tier, _ = offload(tmp_path)
    assert tier.persist([(h, i) for i, h in enumerate(hashes(4))], budget_s=0.0) == 0
    tier.close()
    assert DiskTier(tmp_path, 1 << 30, FMT).num_blocks == 0


def test_the_pool_ranks_blocks_in_use_then_free_ones_newest_first():
    bm = BlockManager(6, BS)
    seqs = [Sequence(str(i), list(range(i * 10, i * 10 + BS)), SamplingParams()) for i in range(3)]
    for s in seqs:
        bm.allocate(s, [], BS)
        s.num_computed_tokens = BS
        bm.cache_computed_blocks(s)
    bm.free_blocks(seqs[0])
    bm.free_blocks(seqs[2])  # freed last: the most recent free block
    order = [bid for _, bid in bm.hashed_by_recency()]
    assert order == [seqs[1].block_table[0], 2, 0]


def test_write_behind_stores_each_block_as_it_is_hashed(tmp_path):
    tier, _ = offload(tmp_path, write_behind=True)
    bm = BlockManager(8, BS, tier=tier)
    s = Sequence("a", list(range(2 * BS + 1)), SamplingParams())
    bm.allocate(s, [], s.num_tokens)
    s.num_computed_tokens = s.num_tokens
    bm.cache_computed_blocks(s)  # two full blocks hashed, still held by the running sequence
    tier.flush()
    assert tier.disk is not None and tier.disk.num_blocks == 2


@pytest.fixture
def silent_port():
    """A port that accepts connections and never answers: a hung Redis."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join()
    for c in held:
        c.close()
    server.close()


def test_a_hung_redis_costs_one_bounded_wait_then_is_skipped(silent_port):
    from cachegw.backend.core.kv_redis import RedisTier

    store = RedisTier(f"redis://127.0.0.1:{silent_port}/0", FMT, ttl_s=60, retry_s=30, timeout_s=0.3)
    assert hashes(1)[0] not in store  # waits timeout_s, then marks Redis down
    assert store.read(hashes(1)[0]) is None  # skipped for retry_s: no second wait, no second error
    store.write(hashes(1)[0], torch.zeros(SHAPE))
    assert store.errors == 1 and store.written == 0
