"""The second KV tier without a model: block files (format, checks, sharing), the RAM tier's LRU, and the
block manager walking from the pool into the tier. The "pool" is a real tensor the tier reads and writes,
as the model runner's KV cache would be."""

from __future__ import annotations

import os

import pytest
import torch

from cachegw.backend.core.block_manager import BlockManager
from cachegw.backend.core.kv_disk import BlockFormat, DiskTier, decode, encode
from cachegw.backend.core.kv_tier import KVOffload
from cachegw.backend.core.sampling_params import SamplingParams
from cachegw.backend.core.sequence import Sequence

BS = 4
SHAPE = (2, 2, BS, 1, 3)  # layers, K/V, block_size, kv_heads, head_dim
FMT = BlockFormat("tiny-model", torch.float32, SHAPE)
H = bytes(range(32))


def block(value: float) -> torch.Tensor:
    return torch.full(SHAPE, value) + torch.arange(3.0)


class Pool:
    """The KV cache the tier moves blocks out of and into: one tensor, a block per row."""

    def __init__(self, num_blocks: int) -> None:
        self.kv = torch.zeros((num_blocks, *SHAPE))

    def read(self, block_id: int) -> torch.Tensor:
        return self.kv[block_id].clone()

    def write(self, block_id: int, data: torch.Tensor) -> None:
        self.kv[block_id].copy_(data)


def tiered(num_blocks: int, ram_blocks: int, disk_dir: str = "") -> tuple[BlockManager, Pool, KVOffload]:
    pool = Pool(num_blocks)
    tier = KVOffload(FMT, pool.read, pool.write, ram_blocks * FMT.payload_bytes, disk_dir, 1 << 30)
    return BlockManager(num_blocks, BS, tier=tier), pool, tier


def run(bm: BlockManager, pool: Pool, tokens: list[int], salt: str | None = None, rid: str = "r") -> Sequence:
    """Admit a sequence (reusing what the tiers hold), 'compute' the rest (each block's K/V filled with
    its first token id), cache its blocks and free it."""
    s = Sequence(rid, tokens, SamplingParams(), cache_salt=salt)
    cached = bm.find_cached_prefix(s)
    n = s.num_tokens - len(cached) * BS
    assert bm.can_allocate(s, cached, n)
    bm.allocate(s, cached, n)
    s.num_cached_tokens = len(cached) * BS
    for i in range(len(cached), len(s.block_table)):
        pool.write(s.block_table[i], block(float(tokens[i * BS])))
    s.num_computed_tokens = s.num_tokens
    bm.cache_computed_blocks(s)
    bm.free_blocks(s)
    return s


def test_a_block_file_round_trips_and_every_check_refuses_what_is_not_it():
    data = block(7.0)
    raw = encode(FMT, H, data)
    assert torch.equal(decode(FMT, H, raw), data)
    assert decode(FMT, H, raw[:-1]) is None  # torn
    flipped = bytearray(raw)
    flipped[-5] ^= 1
    assert decode(FMT, H, bytes(flipped)) is None  # checksum
    assert decode(FMT, bytes(32), raw) is None  # another block's file under this name
    assert decode(BlockFormat("other-model", torch.float32, SHAPE), H, raw) is None  # foreign
    assert decode(BlockFormat("tiny-model", torch.bfloat16, SHAPE), H, raw) is None
    assert decode(FMT, H, b"not a block file at all") is None


def test_disk_tier_ignores_a_corrupted_file_and_deletes_it(tmp_path):
    disk = DiskTier(tmp_path, 1 << 20, FMT)
    disk.write(H, block(1.0))
    path = disk.dir / (H.hex() + ".kv")
    path.write_bytes(path.read_bytes()[:100])  # truncated behind its back
    assert H in disk
    assert disk.read(H) is None and disk.rejected == 1
    assert not path.exists() and H not in disk


def test_disk_index_is_rebuilt_by_scanning_and_trimmed_oldest_first(tmp_path):
    one = len(encode(FMT, H, block(0.0)))
    disk = DiskTier(tmp_path, 3 * one, FMT)
    hashes = [bytes([i]) * 32 for i in range(4)]
    for i, h in enumerate(hashes):
        disk.write(h, block(float(i)))
        os.utime(disk.dir / (h.hex() + ".kv"), (1000 + i, 1000 + i))  # distinct ages for the scan
    assert disk.num_blocks == 3 and hashes[0] not in disk  # the oldest went
    (disk.dir / ".tmp-crashed").write_bytes(b"half a file")
    os.utime(disk.dir / ".tmp-crashed", (1, 1))
    again = DiskTier(tmp_path, 2 * one, FMT)  # a restart with a smaller budget
    assert [h in again for h in hashes] == [False, False, True, True]
    assert torch.equal(again.read(hashes[3]), block(3.0))
    assert not (disk.dir / ".tmp-crashed").exists()


def test_two_processes_share_a_directory_without_a_shared_index(tmp_path):
    a, b = DiskTier(tmp_path, 1 << 20, FMT), DiskTier(tmp_path, 1 << 20, FMT)
    a.write(H, block(5.0))
    assert H in b and torch.equal(b.read(H), block(5.0))  # found by a stat: b's index never had it
    b.write(H, block(5.0))  # a second writer of the same block: an atomic rename of the same bytes
    assert torch.equal(a.read(H), block(5.0))
    other = DiskTier(tmp_path, 1 << 20, BlockFormat("other-model", torch.float32, SHAPE))
    assert H not in other  # another model's files live under another name


def test_evicted_blocks_come_back_from_ram_then_disk_with_their_kv(tmp_path):
    bm, pool, tier = tiered(num_blocks=4, ram_blocks=2, disk_dir=str(tmp_path))
    first = list(range(100, 113))  # 3 full blocks + 1 token
    run(bm, pool, first, rid="a")
    run(bm, pool, list(range(200, 213)), rid="b")  # takes all 4 blocks: a's 3 leave the pool
    tier.flush()
    assert len(tier.ram) == 2 and tier.disk is not None and tier.disk.num_blocks == 1
    again = run(bm, pool, first, rid="c")
    assert again.num_cached_tokens == 12  # every full block, none recomputed
    tier.flush()
    assert bm.hits_by_tier == {"pool": 0, "ram": 8, "disk": 4, "redis": 0}
    for i, block_id in enumerate(again.block_table[:3]):
        assert torch.equal(pool.kv[block_id], block(float(first[i * BS])))


def test_tenants_salts_keep_their_tiered_blocks_apart():
    bm, pool, _ = tiered(num_blocks=4, ram_blocks=8)
    tokens = list(range(13))
    run(bm, pool, tokens, salt="tenant-a", rid="a")
    run(bm, pool, list(range(50, 63)), rid="x")  # evicts a's blocks into RAM
    assert run(bm, pool, tokens, salt="tenant-b", rid="b").num_cached_tokens == 0
    assert run(bm, pool, tokens, salt="tenant-a", rid="a2").num_cached_tokens == 12


def test_loads_never_take_a_block_the_same_prefix_already_holds():
    bm, pool, _ = tiered(num_blocks=3, ram_blocks=8)
    tokens = list(range(9))  # 2 full blocks + 1 token: needs all 3 blocks
    run(bm, pool, tokens, rid="a")
    run(bm, pool, [90, 91, 92, 93, 94], rid="x")  # 2 blocks: evicts a's first block (the oldest free)
    s = Sequence("b", tokens, SamplingParams())
    found = bm.find_cached_prefix(s)
    assert len(set(found)) == len(found) == 2
    assert all(bm.blocks[b].hash == bm.block_hash(s, i) for i, b in enumerate(found))


@pytest.mark.parametrize("ram_blocks", [0, 2])
def test_shutdown_persists_ram_and_pool_so_a_restart_finds_them(tmp_path, ram_blocks):
    bm, pool, tier = tiered(num_blocks=4, ram_blocks=ram_blocks, disk_dir=str(tmp_path))
    tokens = list(range(300, 313))
    run(bm, pool, tokens)
    tier.persist(bm.cached.items())
    tier.close()
    bm2, pool2, tier2 = tiered(num_blocks=4, ram_blocks=ram_blocks, disk_dir=str(tmp_path))
    assert run(bm2, pool2, tokens, rid="after").num_cached_tokens == 12
    assert bm2.hits_by_tier["disk"] == 12
