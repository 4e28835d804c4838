"""config.toml read once: the packaged defaults, with a user's file merged over them key by key.

Both `cachegw serve` (the gateway's sections) and `cachegw backend` (the engine's) read it here, so
neither reaches into the other for loading. A key a user's file still names at its old place is an
error saying where it went (``moved_keys``), never silently ignored.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

DEFAULT_CONFIG_PATH = Path(__file__).resolve().parent.parent / "config.toml"

# Keys that moved, as "section.key" (dotted sub-tables) -> their new place.
MOVED: dict[str, str] = {
    "gateway.builtin_backend_port": "[backend_server] port",
    "gateway.builtin_backend_cpus": '[engine] cpus ("auto" | "all" | a CPU list)',
    "cache.embed_backend": "[cache.encoder] backend",
    "cache.embed_threads": "[cache.encoder] threads",
    "cache.embed_batch_window_ms": "[cache.encoder] batch_window_ms",
    "cache.embed_max_batch": "[cache.encoder] max_batch",
    "cache.verifier_threshold": "[cache.verifier] threshold",
    "cache.verifier_path": "[cache.verifier] path",
    "cache.cross_verifier": "[cache.verifier] cross_verifier",
    "cache.cross_verifier_path": "[cache.verifier] cross_verifier_path",
    "cache.max_false_hit_rate": "[cache.error_bound] max_false_hit_rate",
    "cache.max_false_hit_rate_by_model": "[cache.error_bound] max_false_hit_rate_by_model",
    "cache.max_false_hit_rate_by_tenant": "[cache.error_bound] max_false_hit_rate_by_tenant",
    "cache.false_hit_confidence": "[cache.error_bound] false_hit_confidence",
    "cache.evidence_max_age_s": "[cache.error_bound] evidence_max_age_s",
    "cache.evidence_max_audits": "[cache.error_bound] evidence_max_audits",
    "cache.audit_fraction": "[cache.audits] fraction",
    "cache.audit_max_per_second": "[cache.audits] max_per_second",
    "cache.audit_answer_cosine": "[cache.audits] answer_cosine",
    "cache.audit_priority": "[cache.audits] priority",
    "cache.audit_send_priority": "[cache.audits] send_priority",
}


def merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``over`` laid on ``base`` key by key, tables merged recursively."""
    out = dict(base)
    for key, value in over.items():
        out[key] = (
            merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        )
    return out


def moved_keys(user: Mapping[str, Any]) -> list[str]:
    """Each key of a user's file that moved, with where it went."""
    found = []
    for old, new in MOVED.items():
        *tables, key = old.split(".")
        node: Any = user
        for t in tables:
            node = node.get(t) if isinstance(node, Mapping) else None
        if isinstance(node, Mapping) and key in node:
            found.append(f"[{'.'.join(tables)}] {key} is now {new}")
    cache = user.get("cache")
    if isinstance(cache, Mapping) and isinstance(cache.get("verifier"), bool):  # now a table
        found.append("[cache] verifier is now [cache.verifier] enabled")
    return found


def load_toml(path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """The packaged defaults, with the user's file (if any) merged over them. A moved key is a
    ValueError naming its new place."""
    with open(DEFAULT_CONFIG_PATH, "rb") as f:
        data = tomllib.load(f)
    if path is not None:
        with open(path, "rb") as f:
            user = tomllib.load(f)
        moved = moved_keys(user)
        if moved:
            raise ValueError(f"config {os.fspath(path)}: moved keys: {'; '.join(moved)}")
        data = merge(data, user)
    return data
