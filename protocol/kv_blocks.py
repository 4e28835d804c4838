"""The chained block hashes of a prompt: one definition the engine and the gateway both use.

The engine names each full KV block by a hash of its parent's hash and its own token ids, rooted in
the request's cache salt, so a hash names a whole prefix from position 0 and tenants (salts) never
share one. The gateway hashes a request's tokens the same way to ask which backend already holds
them (``routing = "kv"``): a second copy of these lines that drifted would route every request blind.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterator, Sequence

HASH_BYTES = 32  # sha256


def root_hash(salt: str | None, adapter: str | None = None) -> bytes:
    """The parent of a prompt's first block: the digest of the cache salt (no block has it) and, under
    a LoRA adapter, of the adapter's files, so two adapters never share a block (the base model's roots
    stay as they were, so its disk-tier blocks keep their names)."""
    root = b"cachegw:" + (salt or "").encode()
    return hashlib.sha256(root if adapter is None else root + b"\x00lora:" + adapter.encode()).digest()


def chain_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The hash of one full block given its parent's: the same tokens after the same prefix, same hash."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


def block_hashes(
    tokens: Sequence[int], block_size: int, salt: str | None, adapter: str | None = None
) -> Iterator[bytes]:
    """The hashes of the full blocks of ``tokens``, first block first (a partial last block has none)."""
    parent = root_hash(salt, adapter)
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = chain_hash(parent, tokens[start : start + block_size])
        yield parent
