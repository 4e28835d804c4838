"""Settings an operator changes at run time (admin API, dashboard), layered over config.toml.

The overrides live in the database, not in memory: they survive a restart, every replica on the same
database picks them up (``refresh`` polls a version number), and each change is written with its
audit event in one transaction. A change builds a new frozen ``Settings``; requests read whichever
one is current when they start, so none sees half a change.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, Literal

from pydantic import Field, StrictBool

from cachegw.gateway.bodies import StrictBody, parse_body
from cachegw.gateway.config import CacheConfig, Settings
from cachegw.gateway.storage.admin_store import AdminStore
from cachegw.policies.canonicalize import RULES

KEY = "runtime"
Unit = Annotated[float, Field(ge=0, le=1)]


class ThresholdsPatch(StrictBody):
    default: Unit | None = None
    models: dict[str, Unit | None] | None = None  # None as a value removes that override
    tenants: dict[str, Unit | None] | None = None


class VerifierPatch(StrictBody):
    enabled: bool | None = None
    threshold: Unit | None = None


class EvictionPatch(StrictBody):
    policy: Literal["lru", "lfu"] | None = None
    max_entries: int | None = Field(None, gt=0)
    max_bytes: int | None = Field(None, gt=0)


class CacheSwitches(StrictBody):
    enabled: bool | None = None
    exact: bool | None = None
    semantic: bool | None = None
    serve_temperature_above_zero: bool | None = None


class UnsetTemperaturePatch(StrictBody):
    """Serve cached answers to requests that leave temperature unset: everywhere, per model, per tenant."""

    default: StrictBool | None = None
    models: dict[str, StrictBool | None] | None = None  # None as a value removes that override
    tenants: dict[str, StrictBool | None] | None = None


Rate = Annotated[float, Field(ge=0, lt=1)]


class ErrorBoundPatch(StrictBody):
    """The false-hit target (0 = static thresholds), per model and tenant; the audits' share and budget."""

    max_false_hit_rate: Rate | None = None
    models: dict[str, Rate | None] | None = None  # None as a value removes that override
    tenants: dict[str, Rate | None] | None = None
    audit_fraction: Unit | None = None
    audit_max_per_second: float | None = Field(None, ge=0, le=1e6)


class SettingsPatch(StrictBody):
    """What PUT /admin/api/settings accepts; every part is optional."""

    thresholds: ThresholdsPatch | None = None
    verifier: VerifierPatch | None = None
    ttl_seconds: int | None = Field(None, gt=0)
    max_ttl_seconds: int | None = Field(None, gt=0)
    eviction: EvictionPatch | None = None
    canonicalization: dict[Literal["enabled", *RULES], bool] | None = None  # type: ignore[valid-type]
    cache: CacheSwitches | None = None
    unset_temperature: UnsetTemperaturePatch | None = None
    error_bound: ErrorBoundPatch | None = None


# Where each patch field lands: (section, config field).
_FLAT = {
    ("thresholds", "default"): ("cache", "threshold"),
    ("verifier", "enabled"): ("cache", "verifier"),
    ("verifier", "threshold"): ("cache", "verifier_threshold"),
    ("ttl_seconds",): ("cache", "ttl_seconds"),
    ("max_ttl_seconds",): ("cache", "max_ttl_seconds"),
    ("eviction", "policy"): ("cache", "eviction"),
    ("eviction", "max_entries"): ("cache", "max_entries"),
    ("eviction", "max_bytes"): ("cache", "max_bytes"),
    ("unset_temperature", "default"): ("cache", "serve_unset_temperature"),
    ("error_bound", "max_false_hit_rate"): ("cache", "max_false_hit_rate"),
    ("error_bound", "audit_fraction"): ("cache", "audit_fraction"),
    ("error_bound", "audit_max_per_second"): ("cache", "audit_max_per_second"),
    **{("cache", k): ("cache", k) for k in CacheSwitches.model_fields},
    **{("canonicalization", r): ("canonicalize", r) for r in ("enabled", *RULES)},
}
_MAPS = {
    ("thresholds", "models"): "thresholds_by_model",
    ("thresholds", "tenants"): "thresholds_by_tenant",
    ("unset_temperature", "models"): "serve_unset_temperature_by_model",
    ("unset_temperature", "tenants"): "serve_unset_temperature_by_tenant",
    ("error_bound", "models"): "max_false_hit_rate_by_model",
    ("error_bound", "tenants"): "max_false_hit_rate_by_tenant",
}


def view(s: Settings) -> dict[str, Any]:
    """The GET /admin/api/settings shape of the settings in force."""
    c = s.cache
    return {
        "thresholds": {
            "default": c.threshold,
            "models": dict(c.thresholds_by_model),
            "tenants": dict(c.thresholds_by_tenant),
        },
        "verifier": {"enabled": c.verifier.enabled, "threshold": c.verifier.threshold},
        "ttl_seconds": c.ttl_seconds,
        "max_ttl_seconds": c.max_ttl_seconds,
        "eviction": {"policy": c.eviction, "max_entries": c.max_entries, "max_bytes": c.max_bytes},
        "canonicalization": {
            "enabled": s.canonicalize.enabled,
            **{r: getattr(s.canonicalize, r) for r in RULES},
        },
        "cache": {k: getattr(c, k) for k in CacheSwitches.model_fields},
        "unset_temperature": {
            "default": c.serve_unset_temperature,
            "models": dict(c.serve_unset_temperature_by_model),
            "tenants": dict(c.serve_unset_temperature_by_tenant),
        },
        "error_bound": {
            "max_false_hit_rate": c.error_bound.max_false_hit_rate,
            "models": dict(c.error_bound.max_false_hit_rate_by_model),
            "tenants": dict(c.error_bound.max_false_hit_rate_by_tenant),
            "audit_fraction": c.audits.fraction,
            "audit_max_per_second": c.audits.max_per_second,
        },
    }


def _merge(overrides: dict[str, Any], patch: SettingsPatch) -> dict[str, Any]:
    """Overrides are flat {"cache.threshold": 0.9, "cache.thresholds_by_model": {...}, ...}: by the
    flat [cache] names (``gateway.cache_config.FLAT``), as databases already hold them."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in overrides.items()}
    data = patch.model_dump(exclude_unset=True)
    for path, (section, name) in _FLAT.items():
        node: Any = data
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None:
            out[f"{section}.{name}"] = node
    return out


def apply(base: Settings, overrides: dict[str, Any]) -> Settings:
    """``base`` (from config.toml) with the overrides laid over it."""
    cache: dict[str, Any] = {}
    canon: dict[str, Any] = {}
    for key, value in overrides.items():
        section, name = key.split(".", 1)
        (cache if section == "cache" else canon)[name] = value
    new_cache = base.cache.updated(cache)
    new_canon = base.canonicalize.model_copy(update=canon)
    return base.model_copy(update={"cache": new_cache, "canonicalize": new_canon})


class LiveSettings:
    def __init__(self, base: Settings, store: AdminStore) -> None:
        self.base = base
        self.store = store
        self.overrides: dict[str, Any] = {}
        self.version = 0
        self.current = base

    def load(self) -> Settings:
        """Read the overrides from the database (at start and whenever another replica changed them)."""
        self.overrides, self.version = self.store.get_setting(KEY)
        self.current = apply(self.base, self.overrides)
        return self.current

    def changed_elsewhere(self) -> bool:
        return self.store.setting_version(KEY) != self.version

    def cache_settings(self) -> CacheConfig:
        """The [cache] settings in force (what the cache's parts read at each use)."""
        return self.current.cache

    async def refresh(self) -> None:
        """Pick up a change another replica made (a cheap version read). Every part reads the
        settings in force when it needs them; a request already under way keeps the view it read."""
        if await asyncio.to_thread(self.changed_elsewhere):
            await asyncio.to_thread(self.load)

    def patch(self, body: Any, actor: str) -> Settings:
        """Validate, merge, persist with an audit event; the caller swaps the new settings in."""
        patch = parse_body(SettingsPatch, body, "The settings")
        overrides = _merge(self.overrides, patch)
        for (part, sub), name in _MAPS.items():
            section = getattr(patch, part)
            changes = getattr(section, sub) if section is not None else None
            if changes:
                merged = {**self.current.cache.flat(name), **changes}
                overrides[f"cache.{name}"] = {k: v for k, v in merged.items() if v is not None}
        new = apply(self.base, overrides)
        old_view, new_view = view(self.current), view(new)
        changed = _diff(old_view, new_view)
        audit = {"actor": actor, "action": "settings.update", "target": ",".join(changed)}
        audit["old"] = {k: _at(old_view, k) for k in changed}
        audit["new"] = {k: _at(new_view, k) for k in changed}
        self.version = self.store.put_setting(KEY, overrides, audit)
        self.overrides, self.current = overrides, new
        return new


def _diff(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        name = f"{prefix}{k}"
        if isinstance(va, dict) and isinstance(vb, dict) and k not in ("models", "tenants"):
            out += _diff(va, vb, name + ".")
        elif va != vb:
            out.append(name)
    return out


def _at(d: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d
