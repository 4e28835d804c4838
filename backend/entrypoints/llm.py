"""The offline API, close to vLLM's: ``LLM(...).generate(prompts, params)``.

Torch-free until an ``LLM`` is built: the engine's threads are settled first, as `cachegw backend`
settles them (``cpu_threads.settle_for_script``), and torch is imported after.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any

from cachegw.backend.config import load_engine_config
from cachegw.backend.core.lora_ref import LoRARef, UnknownModel
from cachegw.backend.core.sampling_params import SamplingParams
from cachegw.backend.executor.cpu_threads import settle_for_script

if TYPE_CHECKING:
    from cachegw.backend.core.outputs import RequestOutput

Prompt = str | list[int]


class LLM:
    """Runs the engine to completion over a list of prompts.

    ``model=None`` is the embedded SmolLM2-135M-Instruct. Keyword arguments left as None take
    their value from config.toml [engine], but for ``compile``: a script's engine decodes eagerly
    unless ``compile`` says otherwise (or ``config_path`` names a file that does), since a background
    compile takes a core from the script for minutes on a first run (``"startup"`` compiles before
    returning; a warm Inductor cache makes that seconds). Its threads follow [engine] cpus, threads
    and omp_wait_policy, as under `cachegw backend`.
    """

    _ids = itertools.count()

    def __init__(
        self,
        model: str | None = None,
        *,
        load_format: str | None = None,
        device: str | None = None,
        dtype: str | None = None,
        quantization: str | None = None,
        cpu_kernels: str | None = None,
        block_size: int | None = None,
        kv_cache_tokens: int | None = None,
        kv_cache_bytes: int | None = None,
        kv_cache_dtype: str | None = None,
        gpu_memory_utilization: float | None = None,
        enable_prefix_caching: bool | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        enforce_eager: bool | None = None,
        seed: int | None = None,
        attention_sinks: int | None = None,
        streaming_max_len: int | None = None,
        kv_offload_bytes: int | None = None,
        kv_offload_dir: str | None = None,
        kv_offload_disk_bytes: int | None = None,
        kv_offload_url: str | None = None,
        kv_write_behind: bool | None = None,
        speculative: str | None = None,
        num_speculative_tokens: int | None = None,
        compile: str | None = None,
        fused_decode: bool | None = None,
        preemption_mode: str | None = None,
        swap_space_bytes: int | None = None,
        kv_eviction: str | None = None,
        kv_budget_tokens: int | None = None,
        kv_recent_tokens: int | None = None,
        lora_modules: dict[str, str] | None = None,
        max_loras: int | None = None,
        max_lora_rank: int | None = None,
        config_path: str | None = None,
    ) -> None:
        overrides: dict[str, Any] = dict(
            model=model,
            load_format=load_format,
            device=device,
            dtype=dtype,
            quantization=quantization,
            cpu_kernels=cpu_kernels,
            block_size=block_size,
            kv_cache_tokens=kv_cache_tokens,
            kv_cache_bytes=kv_cache_bytes,
            kv_cache_dtype=kv_cache_dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_prefix_caching=enable_prefix_caching,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enforce_eager=enforce_eager,
            seed=seed,
            attention_sinks=attention_sinks,
            compile=compile,
            fused_decode=fused_decode,
            streaming_max_len=streaming_max_len,
            kv_offload_bytes=kv_offload_bytes,
            kv_offload_dir=kv_offload_dir,
            kv_offload_disk_bytes=kv_offload_disk_bytes,
            kv_offload_url=kv_offload_url,
            kv_write_behind=kv_write_behind,
            speculative=speculative,
            num_speculative_tokens=num_speculative_tokens,
            preemption_mode=preemption_mode,
            swap_space_bytes=swap_space_bytes,
            kv_eviction=kv_eviction,
            kv_budget_tokens=kv_budget_tokens,
            kv_recent_tokens=kv_recent_tokens,
            lora_modules=lora_modules,
            max_loras=max_loras,
            max_lora_rank=max_lora_rank,
        )
        if compile is None and config_path is None:
            overrides["compile"] = "off"
        config = load_engine_config(config_path, **overrides)
        settle_for_script(config)
        from cachegw.backend.core.engine import LLMEngine

        self.engine = LLMEngine(config)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def lora(self, name: str) -> LoRARef:
        """The loaded LoRA adapter ``name``, for ``SamplingParams(lora=...)`` (UnknownModel if none)."""
        loras = self.engine.runner.loras
        ref = loras.ref(name) if loras is not None else None
        if ref is None:
            raise UnknownModel(name)
        return ref

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        cache_salt: str | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in the order given. Prompts are strings or token id lists."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if params is None:
            params = SamplingParams()
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} SamplingParams for {len(prompts)} prompts")
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        try:
            for rid, prompt, p in zip(ids, prompts, plist, strict=True):
                self.engine.add_request(rid, prompt, p, cache_salt=cache_salt)
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        conversations: list[dict[str, str]] | list[list[dict[str, str]]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        **kwargs: Any,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        convs = [conversations] if conversations and isinstance(conversations[0], dict) else conversations
        prompts = [self.chat_prompt_ids(c) for c in convs]  # type: ignore[arg-type]
        return self.generate(prompts, params, **kwargs)

    def chat_prompt_ids(self, conversation: list[dict[str, str]]) -> list[int]:
        return list(
            self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(ids)
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generating", file=sys.stderr, unit="req")
        while pending:
            for out in self.engine.step():
                if out.finished and out.request_id in pending:
                    done[out.request_id] = out
                    pending.discard(out.request_id)
                    if bar is not None:
                        bar.update()
        if bar is not None:
            bar.close()
        return [done[i] for i in ids]
