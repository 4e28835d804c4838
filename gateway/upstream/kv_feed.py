"""Following one backend's KV events (ZeroMQ SUB) into the ``KvIndex``, with replay after a loss.

Batches carry sequence numbers one apart. On start, and after any gap (a dropped connection, a slow
subscriber, messages the PUB socket discarded), the feed asks the backend's replay socket for every
batch from the first one it lacks. A replay that cannot fill the gap (no replay socket, no answer
within ``REPLAY_TIMEOUT_S``, or a buffer that no longer reaches back) drops the backend's entries: it
is rebuilt from the events that follow, which can only make it route less eagerly, never wrongly.
A sequence number that goes back means the engine restarted: its blocks are gone, so are its entries.
A restarted engine's first batches (``AllBlocksCleared``, then what its KV tier holds) go out before
the subscription is back in place, so each time the connection is made again the feed asks the replay
socket for the last batch it applied: a backend that no longer has it restarted, and its history is
replayed from the start at once, instead of at its next event.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from cachegw.gateway.upstream.kv_index import KvIndex
from cachegw.protocol.kv_events import END_SEQ, decode_batch, seq_bytes, seq_of

log = logging.getLogger("cachegw.gateway")

REPLAY_TIMEOUT_S = 2.0
POLL_MS = 100


class EventFeed:
    """One backend's subscription; ``run`` until cancelled."""

    def __init__(self, url: str, endpoint: str, replay_endpoint: str, index: KvIndex) -> None:
        self.url = url
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.index = index
        self.next_seq: int | None = None  # the sequence number expected next
        self.replays = 0  # gaps filled by replay
        self.rebuilds = 0  # gaps that dropped the backend's entries
        self.restarts = 0  # restarts of the backend seen (its numbering went back)
        self._ctx = zmq.asyncio.Context.instance()
        self._sub: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None  # the SUB socket's connections, made and remade
        self._stale: list[zmq.asyncio.Socket] = []  # dropped by ``disconnect``, closed by ``run``
        self._replayed = range(0)  # sequence numbers the last replay delivered (live copies are skipped)

    def _subscribe(self) -> zmq.asyncio.Socket:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self.endpoint)
        return sub

    def disconnect(self) -> None:
        """Drop the connection, as a network fault does: what is published meanwhile is lost to us.
        The socket itself is closed by ``run`` once its bounded wait on it ends (closing a socket under
        a pending poll would cancel the task)."""
        if self._sub is not None:
            self._stale.append(self._sub)
            self._sub = None
        if self._monitor is not None:
            self._stale.append(self._monitor)
            self._monitor = None

    def connect(self) -> None:
        """Subscribe again; the next batch's sequence number shows what was missed meanwhile."""
        self.disconnect()
        self._sub = self._subscribe()
        self._monitor = self._sub.get_monitor_socket(zmq.EVENT_CONNECTED)

    async def run(self) -> None:
        self.connect()
        await self._catch_up(0)  # what the backend stored before we listened, if its buffer holds it
        try:
            while True:
                for stale in self._stale:  # no wait is pending on them now
                    stale.close(linger=0)  # what they received after the drop is lost, as on a network
                self._stale.clear()
                sub = self._sub
                if sub is None:
                    await asyncio.sleep(0.05)
                    continue
                await self._check_connection()
                try:  # a bounded wait: ``disconnect`` may drop this socket meanwhile
                    if not await sub.poll(POLL_MS) or sub is not self._sub:
                        continue
                    frames = await sub.recv_multipart()
                except zmq.ZMQError:
                    if sub is self._sub:  # not closed by disconnect: back off a little
                        await asyncio.sleep(0.1)
                    continue
                if len(frames) == 3:
                    await self._receive(seq_of(frames[1]), frames[2])
        finally:
            self.disconnect()
            for stale in self._stale:
                stale.close(linger=0)

    async def _check_connection(self) -> None:
        """On a connection made (again), ask for the last batch applied: gone means a restart."""
        mon = self._monitor
        if mon is None or not await mon.poll(0):
            return
        try:
            event = parse_monitor_message(await mon.recv_multipart())["event"]
        except (zmq.ZMQError, ValueError, KeyError):
            return
        if event != zmq.EVENT_CONNECTED:
            return
        await self._drain()
        if self.next_seq is None:
            return
        last = self.next_seq - 1
        got = await self._replay(last)
        if got is None or self.next_seq is None:
            return  # no replay socket: the next batch's number tells
        if not got or got[0][0] != last:
            self._restarted(got[0][0] if got else 0)
            await self._catch_up(0)
        elif len(got) > 1:
            self.replays += 1
            for seq, payload in got[1:]:
                if seq >= self.next_seq:
                    self._apply(seq, payload)
            self._replayed = range(last, self.next_seq)

    async def _drain(self) -> None:
        """Apply the batches already received: a slow feed may still hold the old engine's last ones,
        and asking for the last applied before them would count the restart again once they are read."""
        sub = self._sub
        while sub is not None and sub is self._sub and await sub.poll(0):
            try:
                frames = await sub.recv_multipart()
            except zmq.ZMQError:
                return
            if len(frames) == 3:
                await self._receive(seq_of(frames[1]), frames[2])

    def _restarted(self, seq: int) -> None:
        log.info("kv events of %s restarted at %d: its entries are dropped", self.url, seq)
        self.restarts += 1
        self.index.drop(self.url)  # numbering went back: the engine restarted, its blocks are gone
        self.next_seq = None

    async def _receive(self, seq: int, payload: bytes) -> None:
        if self.next_seq is not None and seq < self.next_seq:
            if seq in self._replayed:
                return  # the replay already gave us this one
            self._restarted(seq)
            await self._catch_up(0)
        elif self.next_seq is not None and seq > self.next_seq:
            await self._catch_up(self.next_seq)
        if self.next_seq is None or seq >= self.next_seq:
            self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except msgspec.DecodeError as exc:
            log.warning("kv events of %s: batch %d unreadable (%s): entries dropped", self.url, seq, exc)
            self.index.drop(self.url)
        else:
            self.index.apply(self.url, batch.events)
        self.next_seq = seq + 1

    async def _catch_up(self, first: int) -> None:
        """Ask the replay socket for every batch from ``first``; when that falls short of a gap, drop
        the backend's entries (at start, whatever the buffer holds is only a head start)."""
        got = await self._replay(first)
        if self.next_seq is not None:  # a gap in what we followed
            if not got or got[0][0] > first:
                self.rebuilds += 1
                log.info("kv events of %s: batches from %d lost: its entries are rebuilt", self.url, first)
                self.index.drop(self.url)
            else:
                self.replays += 1
        for seq, payload in got or []:
            if self.next_seq is None or seq >= self.next_seq:
                self._apply(seq, payload)
        self._replayed = range(first, self.next_seq if self.next_seq is not None else first)

    async def _replay(self, first: int) -> list[tuple[int, bytes]] | None:
        """The buffered batches from ``first`` on, or None with no replay socket or no answer."""
        if not self.replay_endpoint:
            return None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay_endpoint)
        out: list[tuple[int, bytes]] = []
        try:
            await sock.send_multipart((b"", seq_bytes(first)))
            while True:
                if not await sock.poll(int(REPLAY_TIMEOUT_S * 1000)):
                    log.warning("kv events of %s: the replay socket did not answer", self.url)
                    return None
                frames = await sock.recv_multipart()
                if len(frames) != 3:
                    continue
                _, seq, payload = frames
                if seq == END_SEQ:
                    return out
                out.append((seq_of(seq), payload))
        finally:
            with contextlib.suppress(zmq.ZMQError):
                sock.close(linger=0)
