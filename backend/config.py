"""Typed configuration read once from config.toml and passed down.

config.toml at the project root holds every default. A user file (``--config``) is merged over
it key by key, so it only needs the keys it changes.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from configtools import typed_section
from configtools.cpus import parse_cpus

DEFAULT_CONFIG_PATH = Path(__file__).resolve().parent.parent / "config.toml"


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = (
            _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        )
    return out


def load_toml(path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """The packaged defaults, with the user's file (if any) merged over them."""
    with open(DEFAULT_CONFIG_PATH, "rb") as f:
        data = tomllib.load(f)
    if path is not None:
        with open(path, "rb") as f:
            data = _merge(data, tomllib.load(f))
    return data


@dataclass(frozen=True)
class EngineConfig:
    """Settings of the built-in engine (config.toml [engine])."""

    model: str
    load_format: str
    device: str
    dtype: str
    quantization: str
    cpu_kernels: str
    block_size: int
    kv_cache_tokens: int
    kv_cache_bytes: int
    kv_cache_dtype: str
    gpu_memory_utilization: float
    enable_prefix_caching: bool
    max_model_len: int
    max_num_seqs: int
    max_n: int
    max_num_batched_tokens: int
    enforce_eager: bool
    cache_dir: str
    seed: int
    grammar_cache_size: int
    attention_sinks: int
    streaming_max_len: int
    kv_offload_bytes: int
    kv_offload_dir: str
    kv_offload_disk_bytes: int
    speculative: str
    num_speculative_tokens: int
    speculative_ngram_min: int
    speculative_ngram_max: int
    speculative_max_seqs: int
    threads: int
    cpus: str
    omp_wait_policy: str
    compile: str

    def __post_init__(self) -> None:
        checks = {
            "load_format": self.load_format in ("auto", "gguf", "safetensors", "dummy"),
            "device": self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"),
            "dtype": self.dtype in ("auto", "float32", "bfloat16", "float16"),
            "quantization": self.quantization in ("auto", "none", "int8", "int4"),
            "cpu_kernels": self.cpu_kernels in ("auto", "torch"),
            "block_size": self.block_size > 0 and self.block_size & (self.block_size - 1) == 0,
            "kv_cache_tokens": self.kv_cache_tokens >= 0,
            "kv_cache_bytes": self.kv_cache_bytes > 0,
            "kv_cache_dtype": self.kv_cache_dtype in ("auto", "int8", "fp8"),
            "gpu_memory_utilization": 0 < self.gpu_memory_utilization <= 1,
            "max_model_len": self.max_model_len >= 0,
            "max_num_seqs": self.max_num_seqs > 0,
            "max_n": self.max_n > 0,
            "max_num_batched_tokens": self.max_num_batched_tokens > 0,
            "grammar_cache_size": self.grammar_cache_size >= 1,
            "attention_sinks": self.attention_sinks >= 0,
            "streaming_max_len": self.streaming_max_len > 0,
            "kv_offload_bytes": self.kv_offload_bytes >= 0,
            "kv_offload_disk_bytes": self.kv_offload_disk_bytes >= 0,
            "speculative": self.speculative in ("off", "ngram"),
            "num_speculative_tokens": self.num_speculative_tokens >= 1,
            "speculative_ngram_min": self.speculative_ngram_min >= 1,
            "speculative_ngram_max": self.speculative_ngram_max >= self.speculative_ngram_min,
            "speculative_max_seqs": self.speculative_max_seqs >= 1,
            "threads": self.threads >= 0,
            "cpus": self._cpus_ok(),
            "omp_wait_policy": self.omp_wait_policy in ("auto", "active", "passive", "runtime"),
            "compile": self.compile in ("background", "startup", "off"),
        }
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            raise ValueError(
                f"invalid engine config value(s): {', '.join(f'{k}={getattr(self, k)!r}' for k in bad)}"
                + ("; quantization is one of auto, none, int8, int4" if "quantization" in bad else "")
                + ("; kv_cache_dtype is one of auto, int8, fp8" if "kv_cache_dtype" in bad else "")
            )

    def _cpus_ok(self) -> bool:
        try:
            return not self.cpus or bool(parse_cpus(self.cpus))
        except ValueError:
            return False

    @property
    def resolved_cache_dir(self) -> Path:
        return Path(os.environ.get("CACHEGW_CACHE_DIR") or self.cache_dir).expanduser()

    def with_overrides(self, **overrides: Any) -> EngineConfig:
        """A copy with the given fields changed; None values keep the configured default."""
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})


@dataclass(frozen=True)
class BackendServerConfig:
    """Settings of `cachegw backend` (config.toml [backend_server])."""

    host: str
    port: int
    served_model_name: str
    max_request_bytes: int


def load_engine_config(path: str | os.PathLike[str] | None = None, **overrides: Any) -> EngineConfig:
    cfg = typed_section(EngineConfig, load_toml(path)["engine"], "engine")
    return cfg.with_overrides(**overrides)


def load_backend_server_config(path: str | os.PathLike[str] | None = None) -> BackendServerConfig:
    return typed_section(BackendServerConfig, load_toml(path)["backend_server"], "backend_server")
