"""The gateway's settings: config.toml's [gateway], [tenants], [cache], [index], [canonicalize]..., typed.

Read once by ``load_settings`` and passed down; unknown keys and out-of-range values are errors
at start-up, not surprises at request time.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict, Field, PrivateAttr, SecretStr, field_validator, model_validator

from cachegw.backend.config import MOVED as ENGINE_MOVED
from cachegw.backend.config import BackendServerConfig, EngineConfig
from cachegw.configtools import Strict as _Strict
from cachegw.configtools import typed_section
from cachegw.configtools.loader import load_toml
from cachegw.gateway.cache_config import MOVED as CACHE_MOVED
from cachegw.gateway.cache_config import CacheConfig
from cachegw.policies.canonicalize_config import CanonicalizeConfig
from cachegw.policies.routing import RoutingMode

__all__ = [
    "BackendSpec",
    "CacheConfig",
    "GatewayConfig",
    "PricingConfig",
    "Settings",
    "TenantsConfig",
    "load_settings",
]


# Every key a user's file may still name at its old place (the engine's, then [cache]'s).
MOVED: dict[str, str] = {**ENGINE_MOVED, **CACHE_MOVED}

# Headers the gateway sets itself on every upstream request; a backend's ``headers`` may not replace them.
_RESERVED_HEADERS = frozenset({"host", "content-length", "content-type", "transfer-encoding", "connection"})


class BackendSpec(_Strict):
    """One upstream server and the credentials the gateway sends to it, and to it only.

    The key is read once at start (``api_key``, or the environment variable ``api_key_env``) and sent
    as ``Authorization: Bearer``; the clients' own keys are never forwarded. Secrets are ``SecretStr``
    and inputs are hidden from validation errors, so neither a repr nor a config error prints them."""

    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    url: str = Field(description="the backend's OpenAI-compatible base URL (http:// or https://)")
    api_key: SecretStr | None = Field(
        default=None, description="sent as Authorization: Bearer to this backend only"
    )
    api_key_env: str | None = Field(
        default=None, description="the environment variable holding the key (read once)"
    )
    headers: dict[str, SecretStr] = Field(
        default_factory=dict, description="extra headers sent to this backend"
    )
    drafts: bool = Field(
        default=False, description="a cachegw engine: a refused near miss's answer goes as `cachegw_draft`"
    )
    pins: bool = Field(
        default=False,
        description="a cachegw engine: prompt-cache pins (Anthropic `cache_control`) go as `cache_pins`",
    )
    kv_events: str = Field(
        default="",
        description='routing = "kv": the ZeroMQ PUB address of its KV events (vLLM format); "" = none',
    )
    kv_events_replay: str = Field(
        default="", description='the ZeroMQ ROUTER address resending missed event batches; "" = none'
    )
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

    host: str = Field(description="address the gateway listens on")
    port: int = Field(ge=0, le=65535, description="its port")
    data_dir: str = Field(description="database and index files (overridden by --data-dir)")
    database_url: str = Field(
        description='"" = SQLite file <data_dir>/cachegw.db (WAL); or any SQLAlchemy URL'
    )
    max_request_bytes: int = Field(gt=0, description="larger bodies get 413")
    connect_timeout_s: float = Field(gt=0, description="to connect to a backend")
    backend_timeout_s: float = Field(gt=0, description="a backend slower than this (per read) gets 504")
    backends: tuple[BackendSpec, ...] = Field(
        description="OpenAI-compatible backends: URLs or tables with credentials; [] = the built-in engine"
    )
    routing: RoutingMode = Field(
        description="several backends of one model: prefix | round_robin | first | kv"
    )
    kv_load_penalty: float = Field(
        ge=0, description='routing = "kv": prompt tokens each running or waiting sequence costs a backend'
    )
    kv_metrics_interval_s: float = Field(
        gt=0, description='routing = "kv": how often each backend\'s /metrics is read for its load'
    )
    kv_tier_weight: float = Field(
        ge=0,
        le=1,
        description='routing = "kv": what a cached token in a backend\'s KV tier (RAM, disk, Redis) is worth'
        " against one in its pool (1 = as much, 0 = nothing)",
    )
    log_query_text: bool = Field(description="the request log keeps the last user message (first 500 chars)")
    probe_interval_s: float = Field(gt=0, description="how often each backend's /health is probed")
    probe_timeout_s: float = Field(gt=0, description="how long a probe may take")
    probe_misses: int = Field(gt=0, description="missed probes in a row that mark a backend down")
    request_log_commit: Literal["batched", "per_request"] = Field(
        description="request-log rows committed in batches every 0.2 s, or before each response is sent"
    )
    metrics_token: str = Field(description='/metrics needs "Authorization: Bearer TOKEN"; "" = no token')
    metrics_host: str = Field(description="with metrics_port: the address of the /metrics listener")
    metrics_port: int = Field(ge=0, le=65535, description="0 = /metrics on the gateway's own port")
    responses_retention_days: float = Field(
        gt=0, description="stored Responses (previous_response_id, GET) are deleted after this many days"
    )
    otlp_endpoint: str = Field(
        description='OTLP/HTTP collector for traces (e.g. "http://127.0.0.1:4318"); "" = '
        "OTEL_EXPORTER_OTLP_ENDPOINT if set, else no tracing"
    )
    request_log_days: float = Field(
        ge=0, description="request-log rows are deleted after this many days; 0 = kept"
    )
    feedback_days: float = Field(
        ge=0, description="bad-hit reports are deleted after this many days; 0 = kept"
    )

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

    def resolved_database_url(self, data_dir: Path) -> str:
        return self.database_url or f"sqlite:///{data_dir / 'cachegw.db'}"


class RateLimit(_Strict):
    """A tenant's budget a minute, counted across replicas in the database (0 = no limit)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    requests_per_minute: int = Field(default=0, ge=0, description="requests a minute, hits included")
    tokens_per_minute: int = Field(
        default=0, ge=0, description="backend tokens (prompt + completion) a minute"
    )


class TenantsConfig(_Strict):
    mode: Literal["open", "keys"] = Field(
        description='"open": any API key is its own tenant; "keys": only those below'
    )
    shared_cache: bool = Field(description="all tenants share one cache (never across models or contexts)")
    # config.toml [tenants] holds the documented defaults of these two
    prefix_isolation: bool = Field(
        default=True, description="each tenant's own cache_salt, so backend prefix caches never leak"
    )
    prefix_groups: dict[str, list[str]] = Field(
        {}, description="group = [tenant names or key hashes] sharing one salt (one backend prefix cache)"
    )
    keys: dict[str, str] = Field(description='name = "api-key", used when mode = "keys"')
    priority_range: tuple[int, int] = Field(
        default=(0, 0), description="the `priority` values any tenant may send: [lowest, highest]"
    )
    priority_ranges: dict[str, tuple[int, int]] = Field(
        default={}, description="tenant name (or key hash) = [lowest, highest] `priority` it may send"
    )
    rate_limits: dict[str, RateLimit] = Field(
        default={},
        description='tenant name, key hash or "*" (every other tenant) = requests and tokens a minute',
    )

    @field_validator("priority_range", "priority_ranges")
    @classmethod
    def _ranges(cls, value: Any) -> Any:
        for lo, hi in [value] if isinstance(value, tuple) else value.values():
            if not -1000 <= lo <= hi <= 1000:
                raise ValueError(
                    f"a priority range is [lowest, highest] within -1000..1000, got [{lo}, {hi}]"
                )
        return value

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


class IndexConfig(_Strict):
    """Where the vectors live, the index's shape (``embeddings.index.ScopedIndex``) and its snapshots."""

    store: Literal["faiss", "pgvector"] = Field(
        description='"faiss": each replica holds the index in memory; "pgvector": one index in PostgreSQL'
    )
    hnsw_threshold: int = Field(
        gt=0, description="entries at which a scope switches from exact search to HNSW"
    )
    hnsw_m: int = Field(gt=0, description="HNSW graph degree")
    ef_construction: int = Field(gt=0, description="HNSW candidate list while building")
    ef_search: int = Field(gt=0, description="HNSW candidate list while searching")
    tombstone_ratio: float = Field(
        gt=0, lt=1, description="deleted share of an HNSW scope that triggers its rebuild"
    )
    snapshots: bool = Field(
        description="save HNSW scopes in <data_dir>/index/ so a restart reads, not rebuilds, them"
    )


class AdminConfig(_Strict):
    """The admin API (/admin/api) and dashboard (/admin)."""

    token: str = Field(description='"" = CACHEGW_ADMIN_TOKEN, else one generated into <data_dir>/admin_token')
    audit_log_days: float = Field(
        ge=0, description="admin audit-log events are deleted after this many days; 0 = kept"
    )


class ModelPrice(_Strict):
    input_per_mtok: float = Field(ge=0, description="USD per million input tokens")
    output_per_mtok: float = Field(ge=0, description="USD per million output tokens")


class PricingConfig(_Strict):
    """USD per million tokens, only to estimate savings."""

    input_per_mtok: float = Field(ge=0, description="USD per million input tokens")
    output_per_mtok: float = Field(ge=0, description="USD per million output tokens")
    cached_input_discount: float = Field(
        ge=0, le=1, description="fraction of the input price a backend prefix-cache hit saves"
    )
    models: dict[str, ModelPrice] = Field(
        description="model = { input_per_mtok = ..., output_per_mtok = ... }"
    )

    def price(self, model: str) -> tuple[float, float]:
        """(input, output) USD per million tokens of ``model``."""
        p = self.models.get(model)
        return (p.input_per_mtok, p.output_per_mtok) if p else (self.input_per_mtok, self.output_per_mtok)


class Settings(_Strict):
    """Everything `cachegw serve` needs, from one config file."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    gateway: GatewayConfig = Field(description="`cachegw serve`: the OpenAI-compatible caching gateway")
    tenants: TenantsConfig = Field(description="who the clients are, and what they share")
    cache: CacheConfig = Field(description="the response cache")
    index: IndexConfig = Field(description="the vector index (embeddings/index.py)")
    canonicalize: CanonicalizeConfig = Field(
        description="prompts made byte-identical for the backend's prefix cache"
    )
    admin: AdminConfig = Field(description="the admin API and dashboard")
    pricing: PricingConfig = Field(description="USD per million tokens, only to estimate savings")
    engine: EngineConfig = Field(description="the built-in inference engine (backend/)")
    backend_server: BackendServerConfig = Field(description="`cachegw backend`: the engine's HTTP server")
    config_path: str | None = Field(
        default=None, description="the user's file, if any (not a config.toml key)"
    )

    @model_validator(mode="after")
    def _pgvector_needs_postgresql(self) -> Settings:
        if self.index.store == "pgvector" and not self.gateway.database_url.startswith("postgresql"):
            raise ValueError(
                '[index] store = "pgvector" needs [gateway] database_url to name a PostgreSQL database '
                "(postgresql+psycopg://user@host/db) whose server has the pgvector extension"
            )
        return self

    @property
    def data_dir(self) -> Path:
        return Path(self.gateway.data_dir).expanduser()


def load_settings(path: str | os.PathLike[str] | None = None, **gateway_overrides: object) -> Settings:
    """Packaged defaults, the user's file merged over them, then command-line overrides. The gateway's
    sections raise pydantic's ValidationError (naming the key), the engine's and [canonicalize] a
    ValueError naming theirs; a moved key, a ValueError naming its new place."""
    raw = load_toml(path, MOVED)
    gateway = {**raw["gateway"], **{k: v for k, v in gateway_overrides.items() if v is not None}}
    return Settings(
        gateway=GatewayConfig.model_validate(gateway),
        tenants=TenantsConfig.model_validate(raw["tenants"]),
        cache=CacheConfig.model_validate(raw["cache"]),
        index=IndexConfig.model_validate(raw["index"]),
        canonicalize=CanonicalizeConfig.from_dict(raw["canonicalize"]),
        admin=AdminConfig.model_validate(raw["admin"]),
        pricing=PricingConfig.model_validate(raw["pricing"]),
        engine=typed_section(EngineConfig, raw["engine"], "engine"),
        backend_server=typed_section(BackendServerConfig, raw["backend_server"], "backend_server"),
        config_path=str(path) if path is not None else None,
    )
