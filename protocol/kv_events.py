"""KV cache events in vLLM's wire format (``vllm/distributed/kv_events.py``), so any consumer of
vLLM's events reads the built-in engine's, and the gateway reads both.

A batch is msgpack of ``KVEventBatch`` (``ts``, ``events``, ``data_parallel_rank``); each event a
tagged struct, its tag the class name first: ``BlockStored`` (the hashes of consecutive full blocks,
the hash before the first, their token ids, the block size, LoRA id and medium), ``BlockRemoved`` and
``AllBlocksCleared``. Sent over ZeroMQ PUB as three frames: topic, an 8-byte big-endian sequence
number, the payload; a ROUTER replay socket answers an 8-byte start sequence with every buffered
``(seq, payload)`` from it and then ``(-1, b"")``.

vLLM wrote structs as arrays (``array_like``) up to 0.11; later versions write maps and add fields
(``lora_name``, ``extra_keys``, ``group_idx``...). ``decode_batch`` reads both into the array types.
"""

from __future__ import annotations

from typing import Any

import msgspec

BlockHash = bytes | int  # vLLM's ExternalBlockHash: ours are 32-byte sha256 digests
MEDIUM_POOL = "GPU"  # vLLM's name for the engine's own KV pool (ours may sit in CPU memory)
# Where offloaded blocks sit: vLLM's CPU offloading publishes "CPU" (with no token ids and no parent, the
# hashes being those its pool blocks had); the built-in engine's RAM tier is "CPU" too, its disk and
# Redis stores "DISK" and "REDIS". A block in one of them is loaded back, not recomputed.
TIER_MEDIUMS = {"ram": "CPU", "disk": "DISK", "redis": "REDIS"}
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's last frame pair: (END_SEQ, b"")


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def seq_of(frame: bytes) -> int:
    return int.from_bytes(frame, "big", signed=True)


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """One change to what an engine's KV cache holds."""


class BlockStored(KVCacheEvent):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockHash]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


# vLLM from 0.12 on: the same events as maps, with fields added (read, then dropped).
class _MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class _MapStored(_MapEvent, tag="BlockStored"):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


class _MapRemoved(_MapEvent, tag="BlockRemoved"):
    block_hashes: list[BlockHash]
    medium: str | None = None


class _MapCleared(_MapEvent, tag="AllBlocksCleared"):
    pass


class _MapBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[_MapStored | _MapRemoved | _MapCleared]
    data_parallel_rank: int | None = None


_ARRAYS = msgspec.msgpack.Decoder(KVEventBatch)
_MAPS = msgspec.msgpack.Decoder(_MapBatch)
_ENCODER = msgspec.msgpack.Encoder()


def encode_batch(batch: KVEventBatch) -> bytes:
    return _ENCODER.encode(batch)


def _from_map(event: Any) -> KVEvent:
    if isinstance(event, _MapStored):
        return BlockStored(
            event.block_hashes,
            event.parent_block_hash,
            event.token_ids,
            event.block_size,
            event.lora_id,
            event.medium,
        )
    if isinstance(event, _MapRemoved):
        return BlockRemoved(event.block_hashes, event.medium)
    return AllBlocksCleared()


def decode_batch(payload: bytes) -> KVEventBatch:
    """A batch in either of vLLM's forms; ``msgspec.DecodeError`` (a ``ValidationError``) if neither."""
    try:
        return _ARRAYS.decode(payload)
    except msgspec.DecodeError:
        batch = _MAPS.decode(payload)
        return KVEventBatch(batch.ts, [_from_map(e) for e in batch.events], batch.data_parallel_rank)
