"""Tool-call ids as OpenAI shapes them (``call_`` + 24 hex digits): the engine names the calls it makes
with them, and the gateway gives every replayed call a fresh one."""

from __future__ import annotations

import secrets


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"
