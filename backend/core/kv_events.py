"""Publishing the block manager's changes as vLLM-format KV events over ZeroMQ.

The block manager hands each change (``stored``, ``removed``, ``cleared``) to a bounded queue and goes
on: the engine thread never encodes, sends or waits. One publisher thread drains the queue, packs what
it found into one ``KVEventBatch`` per drain, sends it on the PUB socket as (topic, sequence, payload)
and keeps the last ``buffer`` batches for the ROUTER replay socket, which a subscriber that saw a gap
asks to resend from a sequence number (``protocol/kv_events.py`` has the format). A full queue drops
the change and the next batch opens with ``AllBlocksCleared``, so a consumer never keeps believing
in a block it missed the removal of: it only loses what it knew.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from itertools import count

import zmq

from cachegw.backend.config import EngineConfig
from cachegw.protocol.kv_events import (
    END_SEQ,
    MEDIUM_POOL,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    encode_batch,
    seq_bytes,
    seq_of,
)

log = logging.getLogger("cachegw.backend")

MAX_QUEUED = 100_000  # changes waiting for the publisher thread; past it they are dropped (see above)
MAX_BATCH = 1024  # events packed into one batch at most


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard or local address is bound (the engine serves it), else connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def publisher_for(config: EngineConfig) -> KVEventPublisher | None:
    """The engine's publisher, or None when ``[engine] kv_events_endpoint`` is empty."""
    if not config.kv_events_endpoint or not config.enable_prefix_caching:
        return None
    publisher = KVEventPublisher(
        config.kv_events_endpoint, config.kv_events_replay_endpoint, config.kv_events_buffer
    )
    publisher.cleared()  # a (re)started engine holds nothing: subscribers forget its earlier blocks
    return publisher


class KVEventPublisher:
    """The engine side of the event stream: ``stored``/``removed``/``cleared`` from the engine thread."""

    def __init__(
        self, endpoint: str, replay_endpoint: str = "", buffer: int = 10_000, topic: str = ""
    ) -> None:
        self._queue: queue.Queue[KVEvent | None] = queue.Queue(maxsize=MAX_QUEUED)
        self._dropped = False
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer)
        self._topic = topic.encode()
        self._seq = count()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(endpoint) if binds(endpoint) else self._pub.connect(endpoint)
        self._replay: zmq.Socket | None = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_endpoint)
        self.sent = 0  # batches published
        self._thread = threading.Thread(target=self._run, name="cachegw-kv-events", daemon=True)
        self._thread.start()

    # -- the engine thread's side: enqueue and return ------------------------------------------------
    def _put(self, event: KVEvent) -> None:
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            self._dropped = True

    def stored(
        self,
        hashes: Sequence[bytes],
        parent: bytes | None,
        tokens: list[int],
        block_size: int,
        medium: str = MEDIUM_POOL,
    ) -> None:
        """Blocks now held; an offload tier's (``medium`` not the pool's) go as vLLM's offloading sends
        them: no parent, no token ids (the hashes are those the blocks had in the pool)."""
        self._put(BlockStored(list(hashes), parent, tokens, block_size, None, medium))

    def removed(self, hashes: Sequence[bytes], medium: str = MEDIUM_POOL) -> None:
        self._put(BlockRemoved(list(hashes), medium))

    def cleared(self) -> None:
        self._put(AllBlocksCleared())

    def close(self) -> None:
        """Send what is queued, then stop (a second or so at most) and close the sockets."""
        try:
            self._queue.put(None, timeout=1.0)
        except queue.Full:
            pass
        self._thread.join(timeout=2.0)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    # -- the publisher thread -------------------------------------------------------------------------
    def _run(self) -> None:
        stop = False
        while not stop:
            self._serve_replays()
            try:
                first = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            events: list[KVEvent] = []
            item: KVEvent | None = first
            while True:
                if item is None:
                    stop = True
                    break
                events.append(item)
                if len(events) >= MAX_BATCH:
                    break
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            if self._dropped:
                self._dropped = False
                events.insert(0, AllBlocksCleared())
            if events:
                self._send(events)
        self._serve_replays()

    def _send(self, events: list[KVEvent]) -> None:
        seq = next(self._seq)
        payload = encode_batch(KVEventBatch(time.time(), events, 0))
        try:
            self._pub.send_multipart((self._topic, seq_bytes(seq), payload))
        except zmq.ZMQError:
            log.exception("kv events: batch %d not sent (a subscriber may replay it)", seq)
        self._buffer.append((seq, payload))
        self.sent += 1

    def _serve_replays(self) -> None:
        """Answer every waiting replay request: the buffered batches from its sequence, then END_SEQ."""
        while self._replay is not None and self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3:
                log.warning("kv events: a replay request of %d frames ignored", len(frames))
                continue
            client, _, start = frames
            first = seq_of(start)
            for seq, payload in list(self._buffer):
                if seq >= first:
                    self._replay.send_multipart((client, b"", seq_bytes(seq), payload))
            self._replay.send_multipart((client, b"", END_SEQ, b""))
