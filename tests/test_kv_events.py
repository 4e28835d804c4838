"""KV events: the block manager's changes in vLLM's format over ZeroMQ, and the gateway's index of them.

The publisher runs on a real ZeroMQ socket; a subscriber decodes with msgspec and vLLM's schema
(``protocol/kv_events.py``, typed, strict). Then the gateway's side: the index under the shared chained
hashes (ours and vLLM's events), and the feed recovering lost batches by replay or by a rebuild.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from cachegw.backend.core.block_manager import BlockManager
from cachegw.backend.core.kv_events import KVEventPublisher
from cachegw.backend.core.sampling_params import SamplingParams
from cachegw.backend.core.sequence import Sequence
from cachegw.gateway.upstream.kv_feed import EventFeed
from cachegw.gateway.upstream.kv_index import KvIndex
from cachegw.protocol.kv_blocks import block_hashes, root_hash
from cachegw.protocol.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    seq_bytes,
    seq_of,
)
from testkit.servers import free_port

BS = 4
VLLM = msgspec.msgpack.Decoder(KVEventBatch)  # vLLM's schema, strict: a wrong field fails the decode


def run(bm: BlockManager, tokens: list[int], salt: str | None = None) -> Sequence:
    """A sequence whose tokens are all computed and whose full blocks are findable (published)."""
    s = Sequence("r", tokens, SamplingParams(), cache_salt=salt)
    cached = bm.find_cached_prefix(s)
    bm.allocate(s, cached, s.num_tokens - len(cached) * BS)
    s.num_computed_tokens = s.num_tokens
    bm.cache_computed_blocks(s)
    return s


@pytest.fixture
def ports() -> tuple[int, int]:
    return free_port(), free_port()


@pytest.fixture
def publisher(ports: tuple[int, int]) -> Iterator[KVEventPublisher]:
    pub = KVEventPublisher(f"tcp://*:{ports[0]}", f"tcp://*:{ports[1]}", buffer=100)
    yield pub
    pub.close()


def replayed(port: int, first: int) -> list[tuple[int, bytes]]:
    """Every batch the replay socket resends from ``first`` (vLLM's replay protocol, over a DEALER)."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{port}")
    sock.send_multipart((b"", seq_bytes(first)))
    out: list[tuple[int, bytes]] = []
    try:
        while True:
            assert sock.poll(5000), "the replay socket did not answer"
            _, seq, payload = sock.recv_multipart()
            if seq == END_SEQ:
                return out
            out.append((seq_of(seq), payload))
    finally:
        sock.close(linger=0)


def wait_sent(pub: KVEventPublisher, n: int) -> None:
    deadline = time.monotonic() + 5
    while pub.sent < n and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pub.sent >= n


def events_of(port: int) -> list:
    return [e for _, payload in replayed(port, 0) for e in VLLM.decode(payload).events]


def test_stored_evicted_and_reset_blocks_are_published_in_vllms_format(publisher, ports) -> None:
    sub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{ports[0]}")
    while True:  # ZeroMQ's slow joiner: publish until the subscription is in place
        publisher.cleared()
        if sub.poll(100):
            break
    bm = BlockManager(4, BS, events=publisher)
    a = run(bm, list(range(10)), salt="tenant-a")  # two full blocks (the 10th token's block is partial)
    topic, seq, payload = sub.recv_multipart()
    while not any(isinstance(e, BlockStored) for e in VLLM.decode(payload).events):
        topic, seq, payload = sub.recv_multipart()
    batch = VLLM.decode(payload)
    stored = next(e for e in batch.events if isinstance(e, BlockStored))
    assert topic == b"" and seq_of(seq) >= 1 and batch.ts > 0
    assert stored.block_hashes == list(block_hashes(list(range(10)), BS, "tenant-a")) == a.block_hashes
    assert stored.parent_block_hash == root_hash("tenant-a")  # the chain's root names the salt
    assert stored.token_ids == list(range(8)) and stored.block_size == BS
    assert stored.lora_id is None and stored.medium == "GPU"
    sub.close(linger=0)

    bm.free_blocks(a)
    b = run(bm, list(range(100, 116)))  # needs all 4 blocks: a's two hashed blocks are evicted
    bm.free_blocks(b)
    assert bm.reset_prefix_cache() == 4  # b's four blocks, all computed
    wait_sent(publisher, 2)
    events = [e for e in events_of(ports[1]) if not isinstance(e, AllBlocksCleared)]
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert set(a.block_hashes) <= set(removed)
    assert set(b.block_hashes) <= set(removed)
    assert all(e.medium == "GPU" for e in events)


def test_replay_resends_every_batch_from_a_sequence_number(publisher, ports) -> None:
    for i in range(5):
        publisher.removed([bytes([i]) * 32])
        wait_sent(publisher, i + 1)  # one batch each
    got = replayed(ports[1], 2)
    assert [seq for seq, _ in got] == [2, 3, 4]
    want = [[BlockRemoved([bytes([i]) * 32], "GPU")] for i in (2, 3, 4)]
    assert [decode_batch(p).events for _, p in got] == want
    assert replayed(ports[1], 9) == []  # nothing that new: only the end marker


def test_the_index_matches_a_request_only_under_its_own_salt() -> None:
    index = KvIndex()
    tokens = list(range(40))
    hashes: list[BlockHash] = list(block_hashes(tokens, BS, "s1"))
    index.apply("a", [BlockStored(hashes[:5], root_hash("s1"), tokens[:20], BS, None, "GPU")])
    assert index.cached_tokens("a", tokens, "s1") == 20
    assert index.cached_tokens("a", tokens, "s2") == 0  # another tenant's blocks never count
    assert index.cached_tokens("a", tokens[:9], "s1") == 8  # the last token's block is always computed
    index.apply("a", [BlockRemoved([hashes[2]], "GPU")])
    assert index.cached_tokens("a", tokens, "s1") == 8  # a run from the first block only
    index.apply("a", [BlockStored(hashes[5:6], None, [], BS, None, "CPU")])  # offloaded: not indexed
    index.apply("a", [AllBlocksCleared()])
    assert index.cached_tokens("a", tokens, "s1") == 0 and index.publishing("a")


def test_vllms_own_hashes_are_translated_through_their_token_ids() -> None:
    """vLLM's hashes are its own (ints here, as vLLM < 0.11 sends): each block is re-hashed from its
    tokens and its parent's translation, in the map form newer vLLM writes."""
    index = KvIndex()
    tokens = list(range(50, 74))
    first = msgspec.msgpack.encode(
        {"ts": 1.0, "events": [{"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": None,
         "token_ids": tokens[:8], "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None}]}
    )  # fmt: skip
    index.apply("v", decode_batch(first).events)
    index.apply("v", [BlockStored([13], 12, tokens[8:12], BS, None, None)])
    index.apply("v", [BlockStored([99], 98, tokens[12:16], BS, None, None)])  # parent unknown: skipped
    assert index.cached_tokens("v", tokens, None) == 12
    index.apply("v", [BlockRemoved([12], "GPU")])
    assert index.cached_tokens("v", tokens, None) == 4


async def _follow(ports: tuple[int, int], replay: bool) -> tuple[EventFeed, KvIndex, list[bytes]]:
    """A feed follows a publisher; its connection drops while blocks 3-5 are stored; blocks 6-7 follow."""
    pub = KVEventPublisher(f"tcp://*:{ports[0]}", f"tcp://*:{ports[1]}" if replay else "", buffer=100)
    index = KvIndex()
    replay_at = f"tcp://127.0.0.1:{ports[1]}" if replay else ""
    feed = EventFeed("b", f"tcp://127.0.0.1:{ports[0]}", replay_at, index)
    task = asyncio.create_task(feed.run())
    tokens = list(range(32))
    hashes = list(block_hashes(tokens, BS, None))

    def store(i: int) -> None:
        parent = hashes[i - 1] if i else root_hash(None)
        pub.stored([hashes[i]], parent, tokens[i * BS : (i + 1) * BS], BS)

    async def until(check, *blocks: int) -> None:
        for _ in range(500):
            if check():
                return
            for i in blocks:  # storing a held block again changes nothing: it only makes batches flow
                store(i)
            await asyncio.sleep(0.01)
        raise AssertionError("the feed never caught up")

    try:
        await until(lambda: index.cached_tokens("b", tokens, None) == 12, 0, 1, 2)
        feed.disconnect()
        sent = pub.sent
        for i in range(3, 6):
            store(i)
        while pub.sent == sent or not pub._queue.empty():  # published while nobody listened
            await asyncio.sleep(0.01)
        feed.connect()
        await until(lambda: index.blocks("b").held >= {hashes[6], hashes[7]}, 6, 7)
        return feed, index, hashes
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        pub.close()


def test_a_dropped_connection_is_made_good_by_replay(ports) -> None:
    feed, index, hashes = asyncio.run(_follow(ports, replay=True))
    assert feed.replays >= 1 and feed.rebuilds == 0
    assert index.blocks("b").held == set(hashes[:8])  # nothing lost: blocks 3-5 came back by replay


def test_without_replay_a_gap_drops_the_backends_entries_and_they_are_rebuilt(ports) -> None:
    feed, index, hashes = asyncio.run(_follow(ports, replay=False))
    assert feed.rebuilds >= 1
    # what it held before the gap is forgotten (never wrongly believed); what came after is known
    assert {hashes[6], hashes[7]} <= index.blocks("b").held and hashes[4] not in index.blocks("b").held


def test_the_score_weighs_the_cached_prefix_against_the_load() -> None:
    from cachegw.gateway.upstream.backend_load import queued_sequences
    from cachegw.policies.kv_routing import KvCandidate, choose

    hashed, other = KvCandidate("h", True, 0, 0), KvCandidate("o", True, 128, 0)
    won = choose([hashed, other], 64.0)
    assert (won.order, won.reason, won.expected_cached_tokens) == (["o", "h"], "prefix", 128)
    busy = KvCandidate("o", True, 128, 3)  # 128 - 3 x 64 < 0: the hash's idle choice wins
    assert choose([hashed, busy], 64.0).reason == "hash"
    assert choose([KvCandidate("h", True, 0, 2), KvCandidate("o", True, 0, 0)], 64.0).reason == "load"
    nobody = [KvCandidate("h", False, 0, 9), KvCandidate("o", False, 0, 0)]
    assert choose(nobody, 64.0).order == ["h", "o"]  # no events anywhere: the hash's order stands
    text = 'vllm:num_requests_running{model_name="m"} 2.0\ncachegw:num_requests_waiting 3.0\n# x 9\n'
    assert queued_sequences(text) == 5


async def _following_an_engine(
    ports: tuple[int, int],
) -> tuple[KVEventPublisher, KvIndex, EventFeed, asyncio.Task[None], list[bytes]]:
    """A feed subscribed to an engine whose pool holds the first two blocks of 16 tokens (the restart
    tests' old engine); the caller cancels the task and closes the publisher."""
    tokens = list(range(16))
    hashes = list(block_hashes(tokens, BS, None))
    pub = KVEventPublisher(f"tcp://*:{ports[0]}", f"tcp://*:{ports[1]}", buffer=100)
    index = KvIndex()
    feed = EventFeed("b", f"tcp://127.0.0.1:{ports[0]}", f"tcp://127.0.0.1:{ports[1]}", index)
    task = asyncio.create_task(feed.run())
    for _ in range(500):
        if index.blocks("b").held >= set(hashes[:2]):
            break
        pub.stored(hashes[:2], root_hash(None), tokens[:8], BS)
        await asyncio.sleep(0.01)
    return pub, index, feed, task, hashes


def test_a_restarted_backend_is_seen_when_the_connection_is_made_again(ports) -> None:
    """The restarted engine's first batches (cleared, then its tier's blocks) go out before the feed is
    subscribed again; the feed finds out from the replay socket at once, with no later event needed."""

    async def follow() -> tuple[EventFeed, KvIndex, list[bytes]]:
        pub, index, feed, task, hashes = await _following_an_engine(ports)
        try:
            for i in range(30):  # a long history: the new engine's numbering starts far below it
                sent = pub.sent
                pub.removed([bytes([i]) * 32])  # a block it never held: one batch each
                while pub.sent == sent:
                    await asyncio.sleep(0.005)
            await asyncio.sleep(0.2)
            pub.close()
            await asyncio.sleep(0.3)
            pub = KVEventPublisher(f"tcp://*:{ports[0]}", f"tcp://*:{ports[1]}", buffer=100)
            pub.cleared()
            pub.stored(hashes[:2], None, [], BS, "REDIS")  # what its shared tier holds, announced at start
            for _ in range(500):
                if feed.restarts and index.blocks("b").tiered.keys() >= set(hashes[:2]):
                    break
                await asyncio.sleep(0.01)
            return feed, index, hashes
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            pub.close()

    feed, index, hashes = asyncio.run(follow())
    assert feed.restarts == 1
    assert index.blocks("b").held == set()  # its pool's blocks are forgotten
    assert index.cached_tokens("b", list(range(16)), None) == 8 and index.cached(
        "b", list(range(9)), None
    ) == (8, 8)


def test_a_restart_is_counted_once_when_the_old_engines_last_batches_are_read_late(ports) -> None:
    """A feed that fell behind still holds the old engine's last batches when the new connection is
    made: they are applied before the replay socket is asked, so the restart is seen once and the new
    engine's first batches, arriving live too, are not taken for a second one."""

    async def follow() -> tuple[EventFeed, KvIndex, list[bytes]]:
        pub, index, feed, task, hashes = await _following_an_engine(ports)
        try:
            # The feed's loop is held up (a busy gateway): what follows reaches its socket unread.
            for i in range(30):
                pub.removed([bytes([i]) * 32])
            time.sleep(0.3)
            pub.close()
            time.sleep(0.3)
            pub = KVEventPublisher(f"tcp://*:{ports[0]}", f"tcp://*:{ports[1]}", buffer=100)
            time.sleep(0.5)  # the subscription is made again meanwhile: the new batches arrive live
            pub.cleared()
            pub.stored(hashes[:2], None, [], BS, "REDIS")
            time.sleep(0.3)
            for _ in range(300):
                await asyncio.sleep(0.01)
                if (
                    feed.restarts
                    and feed.next_seq == 2
                    and index.blocks("b").tiered.keys() >= set(hashes[:2])
                ):
                    break
            await asyncio.sleep(0.3)  # anything still to come would count a second restart
            return feed, index, hashes
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            pub.close()

    feed, index, hashes = asyncio.run(follow())
    assert feed.restarts == 1
    assert index.blocks("b").held == set()
    assert index.blocks("b").tiered.keys() >= set(hashes[:2])
