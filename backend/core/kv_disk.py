"""The disk tier of offloaded KV blocks: one self-describing file per block, least recently used out.

A file is ``<dir>/<model identity digest>/<block hash hex>.kv``: an 8-byte magic, a 4-byte header
length, a JSON header (model identity, dtype, shape, block hash, payload length, crc32 of the payload)
and the raw K/V bytes. A file is written to a temporary name and renamed into place, so a reader sees
a whole file or none; a torn, foreign (other model, dtype or shape) or mismatched file fails the
header or checksum check and is ignored, never loaded as KV.

No index is shared between processes: each one rebuilds its own by scanning the directory at start
(modification time = recency), learns of other processes' files with a ``stat`` when a lookup misses
its index, and deletes the oldest files it knows of when its view of the directory passes the byte
budget. Several engines can therefore share one directory: writes are atomic renames of identical
content (a block's bytes are a function of its hash and the model), and a file deleted while another
process reads it stays readable through the open handle.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import tempfile
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from cachegw.backend.core.kv_tier_events import TierEvents

log = logging.getLogger("cachegw.backend")

MAGIC = b"CGWKV\x00\x01\n"
_LEN = struct.Struct("<I")
_SUFFIX = ".kv"
_STALE_TEMP_SECONDS = 600.0  # a writer's temporary file older than this was left by a crash


@dataclass(frozen=True)
class BlockFormat:
    """What a block file must match to be loaded: the model, the dtype and the block's shape."""

    identity: str  # the model (and anything else that changes K/V values), as text
    dtype: torch.dtype
    shape: tuple[int, ...]  # [layers, 2, block_size, kv_heads, head_dim]

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def digest(self) -> str:
        """The directory of this format's files: other models' files never share its names."""
        text = f"{self.identity}|{self.dtype_name}|{list(self.shape)}"
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def payload_bytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


def encode(fmt: BlockFormat, block_hash: bytes, data: torch.Tensor) -> bytes:
    """A block file's bytes: magic, header length, header, payload."""
    payload = data.contiguous().view(torch.uint8).numpy().tobytes()
    header = json.dumps(
        {
            "identity": fmt.identity,
            "dtype": fmt.dtype_name,
            "shape": list(data.shape),
            "hash": block_hash.hex(),
            "payload_bytes": len(payload),
            "crc32": zlib.crc32(payload),
        },
        sort_keys=True,
    ).encode()
    return MAGIC + _LEN.pack(len(header)) + header + payload


def decode(fmt: BlockFormat, block_hash: bytes, raw: bytes) -> torch.Tensor | None:
    """The block's K/V if ``raw`` is a whole file of this format and hash, else None."""
    head = len(MAGIC) + _LEN.size
    if len(raw) < head or raw[: len(MAGIC)] != MAGIC:
        return None
    (n,) = _LEN.unpack_from(raw, len(MAGIC))
    try:
        header = json.loads(raw[head : head + n])
    except ValueError:
        return None
    payload = memoryview(raw)[head + n :]
    expected = {
        "identity": fmt.identity,
        "dtype": fmt.dtype_name,
        "shape": list(fmt.shape),
        "hash": block_hash.hex(),
        "payload_bytes": fmt.payload_bytes,
    }
    if not isinstance(header, dict) or any(header.get(k) != v for k, v in expected.items()):
        return None
    if len(payload) != fmt.payload_bytes or zlib.crc32(payload) != header.get("crc32"):
        return None
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(fmt.dtype).reshape(fmt.shape)


class DiskTier:
    """Block files under one directory, within a byte budget (thread-safe); a ``kv_store.BlockStore``."""

    name = "disk"

    def __init__(self, root: str | os.PathLike[str], budget_bytes: int, fmt: BlockFormat) -> None:
        self.fmt = fmt
        self.budget = budget_bytes
        self.dir = Path(root).expanduser() / fmt.digest
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._files: OrderedDict[bytes, int] = OrderedDict()  # hash -> file size, oldest first
        self.bytes = 0
        self.rejected = 0  # files that failed the checks
        self.errors = 0  # files that could not be written
        self.events: TierEvents | None = None  # set by the tier when KV events are published
        self._scan()

    def _path(self, block_hash: bytes) -> Path:
        return self.dir / (block_hash.hex() + _SUFFIX)

    def _scan(self) -> None:
        """The index of what a previous run (or another process) left, oldest first."""
        found: list[tuple[float, bytes, int]] = []
        now = time.time()
        for entry in os.scandir(self.dir):
            try:
                st = entry.stat()
                if entry.name.startswith(".tmp-"):
                    if now - st.st_mtime > _STALE_TEMP_SECONDS:
                        os.unlink(entry.path)
                    continue
                if entry.name.endswith(_SUFFIX):
                    found.append((st.st_mtime, bytes.fromhex(entry.name[: -len(_SUFFIX)]), st.st_size))
            except (OSError, ValueError):
                continue  # gone meanwhile, or not one of ours
        for _, h, size in sorted(found):
            self._files[h] = size
            self.bytes += size
        self._trim()

    @property
    def num_blocks(self) -> int:
        return len(self._files)

    def held(self) -> Iterator[bytes]:
        with self._lock:
            found = list(self._files)
        return iter(found)

    def _published(self, block_hash: bytes, stored: bool) -> None:
        if self.events is not None:
            (self.events.stored if stored else self.events.removed)(self.name, [block_hash])

    def __contains__(self, block_hash: bytes) -> bool:
        with self._lock:
            if block_hash in self._files:
                return True
        try:  # another engine sharing the directory may have written it
            size = self._path(block_hash).stat().st_size
        except OSError:
            return False
        with self._lock:
            new = block_hash not in self._files
            if new:
                self._files[block_hash] = size
                self.bytes += size
        if new:  # another engine's file: this one can load it too
            self._published(block_hash, True)
        return True

    def read(self, block_hash: bytes) -> torch.Tensor | None:
        """The block's K/V, or None if its file is missing or fails a check (then it is dropped)."""
        path = self._path(block_hash)
        try:
            raw = path.read_bytes()
        except OSError:
            self._forget(block_hash)
            return None
        data = decode(self.fmt, block_hash, raw)
        if data is None:
            log.warning("KV tier: ignoring %s (torn, foreign or mismatched)", path.name)
            self.rejected += 1
            self._forget(block_hash)
            try:
                path.unlink()
            except OSError:
                pass
            return None
        with self._lock:
            if block_hash in self._files:
                self._files.move_to_end(block_hash)
        try:
            os.utime(path)  # recency for the next scan, here or in another process
        except OSError:
            pass
        return data

    def write(self, block_hash: bytes, data: torch.Tensor, mtime: float | None = None) -> None:
        """Store a block (a temporary file renamed into place), then trim to the budget. ``mtime``: its
        recency for the next start's scan, when not now."""
        if block_hash in self:
            return  # same hash, same model: same bytes
        raw = encode(self.fmt, block_hash, data)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=self.dir)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(raw)
            if mtime is not None:
                os.utime(tmp, (mtime, mtime))
            os.replace(tmp, self._path(block_hash))
        except OSError:
            log.exception("KV tier: could not write a block file")
            self.errors += 1
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return
        with self._lock:
            new = block_hash not in self._files
            if new:
                self._files[block_hash] = len(raw)
                self.bytes += len(raw)
        if new:
            self._published(block_hash, True)
        self._trim()

    def close(self) -> None:
        """Nothing to release: every write is a whole file when it returns."""

    def _forget(self, block_hash: bytes) -> None:
        with self._lock:
            size = self._files.pop(block_hash, None)
            if size is not None:
                self.bytes -= size
        if size is not None:
            self._published(block_hash, False)

    def _trim(self) -> None:
        while True:
            with self._lock:
                if self.bytes <= self.budget or not self._files:
                    return
                h, size = self._files.popitem(last=False)
                self.bytes -= size
            self._published(h, False)
            try:
                self._path(h).unlink()
            except OSError:
                pass  # another process deleted it first
