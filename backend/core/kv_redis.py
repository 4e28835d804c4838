"""KV blocks in Redis, shared by every engine that points at it (``[engine] kv_offload_url``).

One key per block, ``cachegw:kv:<format digest>:<block hash hex>``: the digest names the model identity,
dtype and block shape (``BlockFormat.digest``), so engines of different models share a Redis without
ever reading each other's blocks, and one model's keys can be listed or dropped by their prefix. A value
is a block file's bytes (``kv_disk.encode``: header with identity, dtype, shape, hash and crc32, then the
K/V), checked on every read as on disk: a torn, foreign or mismatched value is ignored and deleted.

Memory stays bounded by a TTL on every key, renewed when a block is read (``GETEX``), and by the
server's own ``maxmemory`` with an ``allkeys-lru`` policy where it is set. Redis being down or slow never
fails a request: an operation that fails counts in ``errors``, is logged, and makes the store answer
"not here" for ``retry_s`` before it tries again; the engine then computes what it would have loaded.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from cachegw.backend.core.kv_disk import BlockFormat, decode, encode

if TYPE_CHECKING:
    from cachegw.backend.core.kv_tier_events import TierEvents

log = logging.getLogger("cachegw.backend")

KEY_PREFIX = "cachegw:kv:"


class RedisTier:
    """A ``kv_store.BlockStore`` on a Redis server (thread-safe: the client keeps a connection pool)."""

    name = "redis"

    def __init__(
        self,
        url: str,
        fmt: BlockFormat,
        ttl_s: int,
        retry_s: float = 5.0,
        timeout_s: float = 2.0,
        client: Any = None,
    ) -> None:
        import redis  # the engine extra's; imported only when a URL is configured

        self.fmt = fmt
        self.ttl_s = ttl_s
        self.retry_s = retry_s
        self.prefix = f"{KEY_PREFIX}{fmt.digest}:"
        self._errors_cls: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self._r = client or redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=min(timeout_s, 0.5)
        )
        self._lock = threading.Lock()
        self._down_until = 0.0
        self.url = url
        self.rejected = 0
        self.errors = 0
        self.written = 0  # blocks this engine stored
        self.found = 0  # blocks this engine read back
        self.events: TierEvents | None = None  # set by the tier when KV events are published

    def _key(self, block_hash: bytes) -> str:
        return self.prefix + block_hash.hex()

    def _call(self, op: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args)``, or None when Redis is marked down or the call fails (then marked down)."""
        if time.monotonic() < self._down_until:
            return None
        try:
            return fn(*args, **kwargs)
        except self._errors_cls as e:
            with self._lock:
                self.errors += 1
                was_up = time.monotonic() >= self._down_until
                self._down_until = time.monotonic() + self.retry_s
            if was_up:
                log.warning("KV tier: Redis %s failed (%s); retrying in %.0f s", op, e, self.retry_s)
            return None

    def __contains__(self, block_hash: bytes) -> bool:
        return bool(self._call("exists", self._r.exists, self._key(block_hash)))

    def read(self, block_hash: bytes) -> torch.Tensor | None:
        key = self._key(block_hash)
        raw = self._call("get", self._r.getex, key, ex=self.ttl_s)
        if raw is None:  # expired (or Redis down): a router should stop counting on it
            if self.events is not None:
                self.events.removed(self.name, [block_hash])
            return None
        data = decode(self.fmt, block_hash, raw)
        if data is None:
            log.warning("KV tier: ignoring Redis key %s (torn, foreign or mismatched)", key)
            with self._lock:
                self.rejected += 1
            self._call("delete", self._r.delete, key)
            if self.events is not None:
                self.events.removed(self.name, [block_hash])
            return None
        with self._lock:
            self.found += 1
        return data

    def write(self, block_hash: bytes, data: torch.Tensor, mtime: float | None = None) -> None:
        """SET with the TTL, only if absent (same hash, same model: same bytes; asked first, so a block
        another engine stored is not sent again). ``mtime`` has no meaning here: Redis keeps its own
        LRU clock."""
        if block_hash in self:  # another engine stored it: this one can load it as well
            if self.events is not None:
                self.events.stored(self.name, [block_hash])
            return
        raw = encode(self.fmt, block_hash, data)
        if self._call("set", self._r.set, self._key(block_hash), raw, ex=self.ttl_s, nx=True):
            with self._lock:
                self.written += 1
            if self.events is not None:
                self.events.stored(self.name, [block_hash])

    def held(self) -> Iterator[bytes]:
        """Every block of this model's prefix in Redis (other engines' too: this one can load them),
        read with SCAN as the caller iterates; nothing more once Redis fails."""
        try:
            for key in self._r.scan_iter(match=self.prefix + "*", count=1000):
                name = key.decode() if isinstance(key, bytes) else str(key)
                try:
                    yield bytes.fromhex(name[len(self.prefix) :])
                except ValueError:
                    continue
        except self._errors_cls as e:
            log.warning("KV tier: listing Redis keys failed (%s)", e)

    @property
    def num_blocks(self) -> int:
        return self.written

    @property
    def bytes(self) -> int:
        return self.written * self.fmt.payload_bytes

    def close(self) -> None:
        try:
            self._r.close()
        except self._errors_cls:
            pass
