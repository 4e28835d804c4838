"""config.toml [canonicalize] as a typed, validated object (what each rule's switch does:
``policies/canonicalize.py``)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from configtools import check_known_keys
from policies.volatile import (
    DEFAULT_VOLATILE_PATTERNS,
    LearnConfig,
    combine,
)


@dataclass(frozen=True)
class CanonicalizeConfig:
    """config.toml [canonicalize]; defaults equal the file's (a test keeps them in step)."""

    enabled: bool = True
    unicode_nfc: bool = True
    line_endings: bool = True
    trailing_whitespace: bool = True
    blank_lines: bool = True
    json_key_order: bool = True
    sort_tools: bool = True
    merge_system: bool = True
    volatile_to_tail: bool = True
    restore_assistant: bool = True
    volatile_patterns: tuple[str, ...] = DEFAULT_VOLATILE_PATTERNS
    learn: LearnConfig = LearnConfig()  # volatile spans learned from traffic ([canonicalize.learn])

    def __post_init__(self) -> None:
        """Validate and compile once at start-up, so a bad setting fails there and not on a request."""
        for f in fields(self):
            if f.type in ("bool", bool) and not isinstance(getattr(self, f.name), bool):
                raise ValueError(f"[canonicalize] {f.name} must be true or false")
        patterns = self.volatile_patterns
        if isinstance(patterns, str) or not all(isinstance(p, str) for p in patterns):
            raise ValueError("[canonicalize] volatile_patterns must be a list of strings")
        object.__setattr__(self, "volatile_patterns", tuple(patterns))
        object.__setattr__(self, "_volatile", combine(self.volatile_patterns))  # not a field
        if not isinstance(self.learn, LearnConfig):
            raise ValueError("[canonicalize] learn must be a table")

    @property
    def volatile_regex(self) -> re.Pattern[str] | None:
        """Every volatile pattern as one case-insensitive alternation (None without patterns)."""
        return self._volatile  # type: ignore[attr-defined, no-any-return]

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CanonicalizeConfig:
        """From the TOML section; an unknown key is a typo that would silently do nothing: an error."""
        check_known_keys(cls, d, "canonicalize")
        learn = d.get("learn", {})
        if not isinstance(learn, Mapping):
            raise ValueError("[canonicalize] learn must be a table")
        check_known_keys(LearnConfig, learn, "canonicalize.learn")
        return cls(**{**d, "learn": LearnConfig(**learn)})
