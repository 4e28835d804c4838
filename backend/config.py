"""The engine's sections of config.toml ([engine], [backend_server]), typed and validated.

Read once (``configtools.loader``: the packaged defaults with a user's file merged over them) and
passed down; an unknown key or an out-of-range value fails at start-up naming the key.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from cachegw.configtools import Strict, section_error, typed_section
from cachegw.configtools.cpus import parse_cpus
from cachegw.configtools.loader import load_toml

# The built-in engine's keys that [gateway] held before the engine had sections of its own.
MOVED: dict[str, str] = {
    "gateway.builtin_backend_port": "[backend_server] port",
    "gateway.builtin_backend_cpus": '[engine] cpus ("auto" | "all" | a CPU list)',
}


class EngineConfig(Strict):
    """Settings of the built-in engine (config.toml [engine])."""

    model: str = Field(
        description='"" = the embedded SmolLM2-135M-Instruct GGUF; else a .gguf file or a local HF folder'
    )
    load_format: Literal["auto", "gguf", "safetensors", "dummy"] = Field(
        description="how to read the model; dummy = random weights, for benchmarks"
    )
    device: str = Field(description="auto (cuda when available) | cpu | cuda | cuda:N")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        description="compute dtype; auto = bfloat16 on CUDA and on CPUs with AMX for float weights, "
        "float32 where the weights run on cachegw's CPU kernels and elsewhere"
    )
    quantization: Literal["auto", "none", "int8", "int4"] = Field(
        description="weight-only int8/int4 linears on CPU; auto = what the GGUF holds, where fast"
    )
    cpu_kernels: Literal["auto", "avx512", "avxvnni", "avx2", "torch"] = Field(
        description="whose CPU kernels run int4/int8 weights: auto = cachegw's best build for this CPU "
        "(AVX-512 VNNI, AVX-VNNI, AVX2), else torch's; a named build is refused where the CPU lacks it"
    )
    block_size: int = Field(gt=0, description="tokens per KV block (a power of two)")
    kv_cache_tokens: int = Field(
        ge=0, description="KV capacity in tokens; 0 = derived from the two settings below"
    )
    kv_cache_bytes: int = Field(gt=0, description="CPU: bytes of KV cache")
    kv_cache_dtype: Literal["auto", "int8", "fp8"] = Field(
        description="what the KV cache stores: auto = the compute dtype | int8 | fp8"
    )
    gpu_memory_utilization: float = Field(
        gt=0, le=1, description="CUDA: fraction of free GPU memory for weights + KV"
    )
    enable_prefix_caching: bool = Field(description="reuse the KV blocks of a prompt prefix seen before")
    max_model_len: int = Field(ge=0, description="0 = the model's max_position_embeddings")
    max_num_seqs: int = Field(gt=0, description="sequences in one batch at most")
    max_n: int = Field(gt=0, description="most samples one request may ask for (n, best_of); above: 400")
    max_num_batched_tokens: int = Field(gt=0, description="tokens per step (prefill chunks + decodes)")
    enforce_eager: bool = Field(description="CUDA: true disables CUDA graphs for decode")
    cache_dir: str = Field(
        description="converted models and compiled kernels; overridden by CACHEGW_CACHE_DIR"
    )
    seed: int = Field(description="seed of requests that bring none")
    grammar_cache_size: int = Field(
        ge=1, description="compiled grammars kept (response_format schemas, tool sets): LRU"
    )
    attention_sinks: int = Field(ge=0, description="StreamingLLM: first tokens always attended; 0 = off")
    streaming_max_len: int = Field(
        gt=0, description="with attention_sinks: the longest a sequence may grow, in tokens"
    )
    kv_offload_bytes: int = Field(ge=0, description="second KV tier in host RAM, bytes; 0 = none")
    kv_offload_dir: str = Field(
        description='disk tier directory ("" = none); engines of one machine may share it'
    )
    kv_offload_disk_bytes: int = Field(ge=0, description="disk tier budget in bytes, each engine trims to it")
    kv_offload_url: str = Field(
        pattern=r"^$|^(redis|rediss|unix)://",
        description='a KV tier shared over the network: "redis://host:port/db" ("" = none)',
    )
    kv_offload_url_ttl_s: int = Field(
        gt=0, description="seconds a block stays in Redis after it was last written or read"
    )
    kv_write_behind: bool = Field(description="copy each hashed block to the disk/Redis tier as it is filled")
    kv_shutdown_budget_s: float = Field(
        ge=0, description="on SIGTERM, seconds given to writing the pool's and RAM's blocks to the tier"
    )
    role: Literal["both", "prefill", "decode"] = Field(
        description="both = prompts and decoding | prefill = prompts' KV for decode engines "
        "(POST /v1/prefill) | decode = long prompts computed by prefill_url, their blocks read from the "
        "shared tier"
    )
    prefill_url: str = Field(
        pattern=r"^$|^https?://", description='decode: the prefill engine\'s base URL ("" = none)'
    )
    prefill_min_tokens: int = Field(
        ge=1, description="decode: prompts with fewer tokens missing from its pool are computed here"
    )
    prefill_timeout_s: float = Field(
        gt=0,
        description="decode: the longest wait for the prefill engine; past it the prompt is computed here",
    )
    kv_events_endpoint: str = Field(
        description='ZeroMQ PUB address of the KV events (vLLM format), e.g. "tcp://*:5557"; "" = off'
    )
    kv_events_replay_endpoint: str = Field(
        description='ZeroMQ ROUTER address that resends missed event batches; "" = no replay'
    )
    kv_events_buffer: int = Field(ge=1, description="event batches kept for replay")
    speculative: Literal["off", "ngram"] = Field(
        description="speculative decoding: off | ngram (prompt lookup)"
    )
    num_speculative_tokens: int = Field(ge=1, description="draft tokens verified per step at most")
    speculative_ngram_min: int = Field(ge=1, description="shortest tail of the sequence looked up (tokens)")
    speculative_ngram_max: int = Field(ge=1, description="longest tail looked up, tried first (>= the min)")
    speculative_max_seqs: int = Field(ge=1, description="drafts only while at most this many sequences run")
    threads: int = Field(ge=0, description="compute threads; 0 = one per core of the engine's cores")
    cpus: str = Field(
        description='the engine\'s cores: "auto" (serve: all but the gateway\'s first) | "all" | a CPU list'
    )
    omp_wait_policy: Literal["auto", "active", "passive", "runtime"] = Field(
        description="how idle OpenMP threads wait; auto = passive with more than one thread"
    )
    pinned_kv_share: float = Field(
        ge=0, le=1, description="most of the KV pool pinned prompt prefixes may hold; 0 = no pins"
    )
    pin_max_ttl_s: float = Field(gt=0, description="longest ttl a cache_pins entry may ask for, seconds")
    pin_in_memory_ttl_s: float = Field(
        gt=0, description='how long prompt_cache_retention "in_memory" pins the prompt, seconds'
    )
    preemption_mode: Literal["recompute", "swap", "auto"] = Field(
        description="a preempted sequence's K/V: recomputed | swapped to host memory | auto (by length)"
    )
    swap_space_bytes: int = Field(ge=0, description="host memory for swapped-out K/V; past it: recompute")
    swap_min_tokens: int = Field(
        ge=0, description="auto: swap sequences with at least this many tokens computed (1: every one)"
    )
    kv_eviction: Literal["none", "h2o"] = Field(
        description="drop KV of tokens past kv_budget_tokens per sequence: none | h2o (Heavy-Hitter Oracle)"
    )
    kv_budget_tokens: int = Field(ge=0, description="h2o: tokens of KV one sequence keeps (> 0 under h2o)")
    kv_recent_tokens: int = Field(
        ge=0, description="h2o: of those, the most recent kept; 0 = half the budget"
    )
    fused_decode: bool = Field(
        description="decode-only steps in one call into cachegw's CPU kernels where the model allows it"
    )
    compile: Literal["background", "startup", "off"] = Field(
        description="decode steps through torch.compile where the fused step cannot run: in a thread after "
        "start-up | before serving | off"
    )
    lora_modules: dict[str, str] = Field(
        description="LoRA adapters served from start: name -> PEFT folder (adapter_config.json + safetensors)"
    )
    max_loras: int = Field(ge=0, description="adapter slots (loaded at start or at run time); 0 = LoRA off")
    max_lora_rank: int = Field(ge=1, description="largest adapter rank a slot holds")

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if v not in ("auto", "cpu", "cuda") and not v.startswith("cuda:"):
            raise ValueError("device is auto, cpu, cuda or cuda:N")
        return v

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError("block_size must be a power of two")
        return v

    @field_validator("cpus")
    @classmethod
    def _cpu_list(cls, v: str) -> str:
        if v not in ("auto", "all"):
            parse_cpus(v)  # ValueError: not a CPU list
        return v

    @model_validator(mode="after")
    def _ngram_range(self) -> EngineConfig:
        if self.speculative_ngram_max < self.speculative_ngram_min:
            raise ValueError("speculative_ngram_max must be >= speculative_ngram_min")
        return self

    @model_validator(mode="after")
    def _h2o_budget(self) -> EngineConfig:
        """H2O's budget holds its sinks and recent window, and nothing asked for lacks attention scores."""
        if self.kv_eviction != "h2o":
            return self
        kept = self.attention_sinks + self.kv_recent_tokens
        if self.kv_budget_tokens <= 0 or self.kv_budget_tokens < kept:
            raise ValueError(
                'kv_eviction = "h2o" needs kv_budget_tokens > 0 and >= attention_sinks + kv_recent_tokens'
            )
        if self.speculative != "off":
            raise ValueError(
                'kv_eviction = "h2o" cannot take back rejected draft tokens: set speculative = "off"'
            )
        if self.compile == "startup":
            raise ValueError(
                'kv_eviction = "h2o" needs attention weights, which the compiled decode step\'s fused '
                'attention never forms: set compile = "off" (or "background", which h2o leaves unused)'
            )
        return self

    @model_validator(mode="after")
    def _roles(self) -> EngineConfig:
        """A prefill or decode engine hands blocks over through a store both read: refused without one."""
        shared = bool(self.kv_offload_url or self.kv_offload_dir)
        if self.role != "both" and not (shared and self.enable_prefix_caching):
            raise ValueError(
                f'role = "{self.role}" hands prompts\' KV over through a shared tier: set kv_offload_url '
                '("redis://...") or kv_offload_dir (one machine), and keep enable_prefix_caching on'
            )
        if self.role == "decode" and not self.prefill_url:
            raise ValueError('role = "decode" needs prefill_url, the prefill engine\'s "http://host:port"')
        if self.prefill_url and self.role != "decode":
            raise ValueError(f'prefill_url is for role = "decode" engines (this one is role = "{self.role}")')
        return self

    @model_validator(mode="after")
    def _swap_space(self) -> EngineConfig:
        if self.preemption_mode != "recompute" and self.swap_space_bytes <= 0:
            raise ValueError(
                f'preemption_mode = "{self.preemption_mode}" with swap_space_bytes = 0 would recompute every '
                'preempted sequence: give it host memory, or set preemption_mode = "recompute"'
            )
        return self

    @model_validator(mode="after")
    def _lora_slots(self) -> EngineConfig:
        if len(self.lora_modules) > self.max_loras:
            raise ValueError(
                f"lora_modules names {len(self.lora_modules)} adapters but max_loras = {self.max_loras}: "
                "raise max_loras (each slot costs memory: docs/engine.md, LoRA adapters)"
            )
        return self

    @property
    def resolved_cache_dir(self) -> Path:
        return Path(os.environ.get("CACHEGW_CACHE_DIR") or self.cache_dir).expanduser()

    def with_overrides(self, **overrides: Any) -> EngineConfig:
        """A copy with the given fields changed (validated); None values keep the configured default."""
        changed = {k: v for k, v in overrides.items() if v is not None}
        if not changed:
            return self
        try:
            return type(self).model_validate({**self.model_dump(), **changed})
        except ValidationError as e:
            raise section_error(e, "engine") from None


class BackendServerConfig(Strict):
    """Settings of `cachegw backend` (config.toml [backend_server])."""

    host: str = Field(description="address the engine's HTTP server listens on")
    port: int = Field(
        ge=0, le=65535, description="its port; also where `cachegw serve` starts its built-in engine"
    )
    served_model_name: str = Field(
        description='"" = derived from the model ("SmolLM2-135M-Instruct" for the default)'
    )
    max_request_bytes: int = Field(gt=0, description="larger bodies get 413 (above the gateway's own limit)")
    admin_token: str = Field(
        description='the engine\'s admin endpoints (LoRA load/unload): "" = loopback clients only; '
        "else `Authorization: Bearer <token>` from anywhere"
    )


def load_engine_config(path: str | os.PathLike[str] | None = None, **overrides: Any) -> EngineConfig:
    cfg = typed_section(EngineConfig, load_toml(path, MOVED)["engine"], "engine")
    return cfg.with_overrides(**overrides)


def load_backend_server_config(path: str | os.PathLike[str] | None = None) -> BackendServerConfig:
    return typed_section(BackendServerConfig, load_toml(path, MOVED)["backend_server"], "backend_server")
