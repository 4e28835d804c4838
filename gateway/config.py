"""The gateway's settings: config.toml's [gateway], [tenants], [cache], [index], [canonicalize]..., typed.

Read once by ``load_settings`` and passed down; unknown keys and out-of-range values are errors
at start-up, not surprises at request time.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr, field_validator, model_validator

from backend.config import BackendServerConfig, EngineConfig, load_toml
from configtools import typed_section
from configtools.cpus import parse_cpus
from policies.canonicalize_config import CanonicalizeConfig
from policies.evidence_window import Ageing
from policies.routing import RoutingMode


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# Headers the gateway sets itself on every upstream request; a backend's ``headers`` may not replace them.
_RESERVED_HEADERS = frozenset({"host", "content-length", "content-type", "transfer-encoding", "connection"})


class BackendSpec(_Strict):
    """One upstream server and the credentials the gateway sends to it, and to it only.

    The key is read once at start (``api_key``, or the environment variable ``api_key_env``) and sent
    as ``Authorization: Bearer``; the clients' own keys are never forwarded. Secrets are ``SecretStr``
    and inputs are hidden from validation errors, so neither a repr nor a config error prints them."""

    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    url: str
    api_key: SecretStr | None = None
    api_key_env: str | None = None
    headers: dict[str, SecretStr] = Field(default_factory=dict)
    drafts: bool = False  # it takes `cachegw_draft` (a cachegw engine): a refused near miss's answer
    _key: str = PrivateAttr("")

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"a backend url must start with http:// or https://, got {url!r}")
        return url.rstrip("/")

    @model_validator(mode="after")
    def _resolve_key(self) -> BackendSpec:
        if self.api_key is not None and self.api_key_env is not None:
            raise ValueError(f"backend {self.url}: give api_key or api_key_env, not both")
        if self.api_key_env is not None:
            value = os.environ.get(self.api_key_env, "")
            if not value:
                raise ValueError(
                    f"backend {self.url}: environment variable {self.api_key_env} (api_key_env) is not set"
                )
            self._key = value
        elif self.api_key is not None:
            self._key = self.api_key.get_secret_value()
        names = {name.lower() for name in self.headers}
        if names & _RESERVED_HEADERS:
            raise ValueError(f"backend {self.url}: headers may not set {sorted(names & _RESERVED_HEADERS)}")
        if self._key and "authorization" in names:
            raise ValueError(f"backend {self.url}: an api key and an Authorization header: give one")
        return self

    def upstream_headers(self) -> dict[str, str]:
        """What every request to this backend carries (model listing and health probes included)."""
        out = {name: value.get_secret_value() for name, value in self.headers.items()}
        if self._key:
            out["Authorization"] = f"Bearer {self._key}"
        return out


class GatewayConfig(_Strict):
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    host: str
    port: int = Field(ge=0, le=65535)
    data_dir: str
    database_url: str
    max_request_bytes: int = Field(gt=0)
    connect_timeout_s: float = Field(gt=0)
    backend_timeout_s: float = Field(gt=0)
    backends: tuple[BackendSpec, ...]
    routing: RoutingMode
    builtin_backend_port: int = Field(ge=0, le=65535)
    builtin_backend_cpus: str
    log_query_text: bool
    probe_interval_s: float = Field(gt=0)
    probe_timeout_s: float = Field(gt=0)
    probe_misses: int = Field(gt=0)
    request_log_commit: Literal["batched", "per_request"]
    metrics_token: str
    metrics_host: str
    metrics_port: int = Field(ge=0, le=65535)

    @field_validator("backends", mode="before")
    @classmethod
    def _url_or_table(cls, entries: Any) -> Any:
        """Each entry is a URL, or a table with ``url`` and its credentials."""
        if not isinstance(entries, list | tuple):
            return entries
        return tuple({"url": e} if isinstance(e, str) else e for e in entries)

    @field_validator("backends")
    @classmethod
    def _distinct(cls, specs: tuple[BackendSpec, ...]) -> tuple[BackendSpec, ...]:
        urls = [s.url for s in specs]
        if len(set(urls)) != len(urls):
            raise ValueError(f"a backend is listed twice: {sorted({u for u in urls if urls.count(u) > 1})}")
        return specs

    @field_validator("builtin_backend_cpus")
    @classmethod
    def _cpu_setting(cls, value: str) -> str:
        if value not in ("auto", "all"):
            parse_cpus(value)  # ValueError: not a CPU list
        return value

    def resolved_database_url(self, data_dir: Path) -> str:
        return self.database_url or f"sqlite:///{data_dir / 'cachegw.db'}"


class TenantsConfig(_Strict):
    mode: Literal["open", "keys"]
    shared_cache: bool
    prefix_isolation: bool = True  # config.toml [tenants] holds the documented default
    prefix_groups: dict[str, list[str]] = {}  # group = [tenant names or key hashes] sharing one salt
    keys: dict[str, str]

    @field_validator("keys")
    @classmethod
    def _unique_keys(cls, keys: dict[str, str]) -> dict[str, str]:
        if len(set(keys.values())) != len(keys):
            raise ValueError("two tenants share one API key")
        return keys

    @field_validator("prefix_groups")
    @classmethod
    def _one_group_each(cls, groups: dict[str, list[str]]) -> dict[str, list[str]]:
        seen: dict[str, str] = {}
        for group, members in groups.items():
            if not group or not members or any(not m for m in members):
                raise ValueError("a prefix group needs a name and at least one tenant, none empty")
            for m in members:
                if m in seen and seen[m] != group:
                    raise ValueError(f"tenant {m!r} is in two prefix groups ({seen[m]!r} and {group!r})")
                seen[m] = group
        return groups


Threshold = float


class CacheConfig(_Strict):
    enabled: bool
    exact: bool
    semantic: bool
    threshold: float = Field(ge=0, le=1)
    thresholds_by_model: dict[str, Threshold]
    thresholds_by_tenant: dict[str, Threshold]
    verifier: bool
    verifier_threshold: float = Field(ge=0, le=1)
    verifier_path: str  # "" = the artifact shipped in policies/artifacts
    cross_verifier: bool
    cross_verifier_path: str
    ttl_seconds: int = Field(gt=0)
    max_ttl_seconds: int = Field(gt=0)
    max_entries: int = Field(gt=0)
    max_bytes: int = Field(gt=0)
    eviction: Literal["lru", "lfu"]
    serve_temperature_above_zero: bool
    serve_unset_temperature: bool
    serve_unset_temperature_by_model: dict[str, bool]
    serve_unset_temperature_by_tenant: dict[str, bool]
    embed_batch_window_ms: float = Field(ge=0)
    embed_max_batch: int = Field(gt=0)
    feedback_margin: float = Field(ge=0, le=1)
    embed_backend: Literal["auto", "onnx", "torch"]
    embed_threads: int = Field(gt=0)
    sync_interval_s: float = Field(ge=0)
    max_false_hit_rate: float = Field(ge=0, lt=1)  # 0 = off: the static thresholds above decide
    max_false_hit_rate_by_model: dict[str, float]
    max_false_hit_rate_by_tenant: dict[str, float]
    false_hit_confidence: float = Field(gt=0, lt=1)
    audit_fraction: float = Field(ge=0, le=1)
    audit_max_per_second: float = Field(ge=0)
    audit_answer_cosine: float = Field(ge=0, le=1)
    audit_priority: int = Field(ge=-1000, le=1000)  # vLLM's `priority` of the re-asks: lower first
    audit_send_priority: Literal["auto", "always", "never"]
    evidence_max_age_s: float = Field(ge=0)  # 0: evidence never expires
    evidence_max_audits: int = Field(ge=0)  # per scope (and entry), the newest N; 0: no limit

    @property
    def ageing(self) -> Ageing:
        return Ageing(self.evidence_max_age_s, self.evidence_max_audits)

    @field_validator("max_false_hit_rate_by_model", "max_false_hit_rate_by_tenant")
    @classmethod
    def _rates(cls, values: dict[str, float]) -> dict[str, float]:
        bad = {k: v for k, v in values.items() if not 0 <= v < 1}
        if bad:
            raise ValueError(f"false-hit rates must be in [0, 1): {bad}")
        return values

    def false_hit_target(self, model: str, tenant_name: str) -> float:
        """The false-hit rate the scope must stay under (0 = static thresholds): per-tenant over
        per-model over the global one, as the thresholds."""
        by_model = self.max_false_hit_rate_by_model.get(model, self.max_false_hit_rate)
        return self.max_false_hit_rate_by_tenant.get(tenant_name, by_model)

    @field_validator("thresholds_by_model", "thresholds_by_tenant")
    @classmethod
    def _in_unit_range(cls, values: dict[str, float]) -> dict[str, float]:
        bad = {k: v for k, v in values.items() if not 0 <= v <= 1}
        if bad:
            raise ValueError(f"thresholds must be in [0, 1]: {bad}")
        return values

    def serves_unset_temperature(self, model: str, tenant_name: str) -> bool:
        """Whether a request leaving ``temperature`` unset may be served from (and stored into) the cache:
        per-tenant over per-model over the global switch, as the thresholds."""
        by_model = self.serve_unset_temperature_by_model.get(model, self.serve_unset_temperature)
        return self.serve_unset_temperature_by_tenant.get(tenant_name, by_model)


class IndexConfig(_Strict):
    """The vector index's shape (``embeddings.index.ScopedIndex``) and whether it snapshots to disk."""

    hnsw_threshold: int = Field(gt=0)
    hnsw_m: int = Field(gt=0)
    ef_construction: int = Field(gt=0)
    ef_search: int = Field(gt=0)
    tombstone_ratio: float = Field(gt=0, lt=1)
    snapshots: bool


class AdminConfig(_Strict):
    token: str


class ModelPrice(_Strict):
    input_per_mtok: float = Field(ge=0)
    output_per_mtok: float = Field(ge=0)


class PricingConfig(_Strict):
    """USD per million tokens, only to estimate savings."""

    input_per_mtok: float = Field(ge=0)
    output_per_mtok: float = Field(ge=0)
    cached_input_discount: float = Field(ge=0, le=1)
    models: dict[str, ModelPrice]

    def price(self, model: str) -> tuple[float, float]:
        """(input, output) USD per million tokens of ``model``."""
        p = self.models.get(model)
        return (p.input_per_mtok, p.output_per_mtok) if p else (self.input_per_mtok, self.output_per_mtok)


class Settings(_Strict):
    """Everything `cachegw serve` needs, from one config file."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    gateway: GatewayConfig
    tenants: TenantsConfig
    cache: CacheConfig
    index: IndexConfig
    canonicalize: CanonicalizeConfig
    admin: AdminConfig
    pricing: PricingConfig
    engine: EngineConfig
    backend_server: BackendServerConfig
    config_path: str | None = None

    @property
    def data_dir(self) -> Path:
        return Path(self.gateway.data_dir).expanduser()


def load_settings(path: str | os.PathLike[str] | None = None, **gateway_overrides: object) -> Settings:
    """Packaged defaults, the user's file merged over them, then command-line overrides."""
    raw = load_toml(path)
    gateway = {**raw["gateway"], **{k: v for k, v in gateway_overrides.items() if v is not None}}
    return Settings(
        gateway=GatewayConfig(**gateway),
        tenants=TenantsConfig(**raw["tenants"]),
        cache=CacheConfig(**raw["cache"]),
        index=IndexConfig(**raw["index"]),
        canonicalize=CanonicalizeConfig.from_dict(raw["canonicalize"]),
        admin=AdminConfig(**raw["admin"]),
        pricing=PricingConfig(**raw["pricing"]),
        engine=typed_section(EngineConfig, raw["engine"], "engine"),
        backend_server=typed_section(BackendServerConfig, raw["backend_server"], "backend_server"),
        config_path=str(path) if path is not None else None,
    )
