"""Config sections as typed dataclasses: the one helper the engine's and the policies' sections share.

A package of its own, importing nothing of ours, so ``backend/``, ``policies/`` and ``gateway/`` may all
use it without an import against the one-way graph (tests/test_import_graph.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any, TypeVar

T = TypeVar("T")


def check_known_keys(cls: type, raw: Mapping[str, Any], section: str) -> None:
    """An unknown key is a typo that would silently do nothing: an error naming it."""
    unknown = set(raw) - {f.name for f in fields(cls)}
    if unknown:
        raise ValueError(f"config [{section}]: unknown keys {sorted(unknown)}")


def typed_section(cls: type[T], raw: Mapping[str, Any], section: str) -> T:
    """A config section as its dataclass; unknown keys are an error, not silently ignored."""
    check_known_keys(cls, raw, section)
    return cls(**raw)
