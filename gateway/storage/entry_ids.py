"""``x-cache-entry``: an opaque id per tenant, so a tenant learns nothing from the ids it is shown.

The database's entry ids are one global counter: shown as they are, two hits of one tenant would
tell it how many entries other tenants stored in between. The id a tenant sees is one AES block
holding the entry id and a tag bound to the tenant (an HMAC of the tenant's id and the entry id),
keyed by secrets derived from the admin token, as the prefix salts are: every replica with the same
token reads the same ids back. The block cipher makes the ids unordered and unreadable without the
key; the tag makes the same entry show a different id to each tenant (tenants sharing a cache too),
and an id shown to another tenant fail to decode for this one.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
import struct
from functools import lru_cache

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from cachegw.gateway.storage.tables import MAX_ID

PREFIX = "ce-"
_FORM = re.compile(r"^ce-[A-Za-z0-9_-]{22}$")  # 16 bytes in unpadded base64url
_TAG = 8


class EntryIds:
    def __init__(self, admin_token: str) -> None:
        root = hashlib.sha256(b"cachegw-entry-id\0" + admin_token.encode()).digest()
        self._cipher = Cipher(algorithms.AES(hmac.new(root, b"cipher", hashlib.sha256).digest()), modes.ECB())
        self._mac_key = hmac.new(root, b"tag", hashlib.sha256).digest()
        # a hit shows its entry's id: the same few entries are shown again and again
        self._shown = lru_cache(maxsize=16384)(self._encode)

    def _tag(self, tenant_id: str, entry_id: int) -> bytes:
        msg = tenant_id.encode() + b"\0" + struct.pack(">Q", entry_id)
        return hmac.new(self._mac_key, msg, hashlib.sha256).digest()[:_TAG]

    def encode(self, tenant_id: str, entry_id: int) -> str:
        """The id ``tenant_id`` is shown for entry ``entry_id``."""
        return self._shown(tenant_id, entry_id)

    def _encode(self, tenant_id: str, entry_id: int) -> str:
        """One AES block (ECB is the bare cipher)."""
        enc = self._cipher.encryptor()
        block = enc.update(struct.pack(">Q", entry_id) + self._tag(tenant_id, entry_id)) + enc.finalize()
        return PREFIX + base64.urlsafe_b64encode(block).rstrip(b"=").decode()

    def _open(self, text: str) -> tuple[int, bytes] | None:
        if not _FORM.match(text):
            return None
        try:
            block = base64.urlsafe_b64decode(text[len(PREFIX) :] + "==")
        except (binascii.Error, ValueError):
            return None
        dec = self._cipher.decryptor()
        plain = dec.update(block) + dec.finalize()
        return struct.unpack(">Q", plain[:8])[0], plain[8:]

    def decode(self, tenant_id: str, text: str) -> int | None:
        """The entry id behind an id shown to ``tenant_id``; None for an id it was never shown
        (another tenant's, a made-up one): the caller answers both alike."""
        opened = self._open(text)
        if opened is None:
            return None
        entry_id, tag = opened
        ok = 1 <= entry_id <= MAX_ID and hmac.compare_digest(tag, self._tag(tenant_id, entry_id))
        return entry_id if ok else None

    def decode_any(self, text: str) -> int | None:
        """For the admin API: the entry id behind any tenant's id (the tenant is not checked)."""
        opened = self._open(text)
        return opened[0] if opened is not None and 1 <= opened[0] <= MAX_ID else None

    @staticmethod
    def looks_opaque(text: str) -> bool:
        return bool(_FORM.match(text))
