"""Runs the model on one scheduled batch: flat inputs in, logits of the sampled positions out.

It owns the weights and the KV cache (one K and one V tensor per layer, shaped
[num_blocks, block_size, kv_heads, head_dim]) and, on CUDA, the captured decode graphs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from cachegw.backend.config import EngineConfig
from cachegw.backend.core.block_manager import FREED, cdiv
from cachegw.backend.core.h2o import check_h2o
from cachegw.backend.core.lora_ref import LoRARef, UnknownModel
from cachegw.backend.core.scheduler import ScheduledBatch
from cachegw.backend.executor import gpu_kernels
from cachegw.backend.executor.compiled_decode import CompiledDecode, start_compiling, will_compile
from cachegw.backend.executor.cuda_graphs import DecodeGraphs
from cachegw.backend.executor.fused_decode import fused_decode_for
from cachegw.backend.executor.layers import kv_quant
from cachegw.backend.executor.layers.attention import AttentionMetadata, PagedAttention
from cachegw.backend.executor.lora_slots import LoRASlots, lora_slots_for
from cachegw.backend.executor.model_weights import build_model
from cachegw.backend.executor.models.registry import model_spec
from cachegw.backend.executor.quantization import use_native_kernels

log = logging.getLogger("cachegw.backend")


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_indices: torch.Tensor  # rows of the flat batch whose logits are sampled
    sample_seq_indices: list[int]  # which batch entries those rows belong to (1 + its drafts each)
    # batch entry -> (flat rows, first position): prompt positions whose logits score the next prompt token
    prompt_rows: dict[int, tuple[torch.Tensor, int]]


@dataclass
class StepOutput:
    logits: torch.Tensor  # float32 [rows, vocab] of the sampled positions
    rows: list[int]  # the batch entries they belong to (consecutive rows for a sequence's drafts)
    # batch entry -> (first position, hidden states of its prompt positions): see ModelRunner.logits
    prompt_hidden: dict[int, tuple[int, torch.Tensor]]
    key_mass: torch.Tensor | None = None  # H2O: attention each cached key received this step


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        hf_config,
        model_dir,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
        gguf_path: Path | None = None,
        context: int | None = None,
    ) -> None:
        """``max_model_len``: the longest sequence; ``context``: the most positions one query may
        span, when attention sinks let sequences run past it (``[engine] attention_sinks``)."""
        self.config, self.device, self.dtype = config, device, dtype
        # cachegw's CPU kernels ([engine] cpu_kernels), chosen before the weights load: a build the
        # CPU lacks is refused at once
        native = use_native_kernels(config.cpu_kernels) if device.type == "cpu" else None
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.spec = model_spec(hf_config, config, gguf_path)
        kv_quant.check_supported(config.kv_cache_dtype, device)
        kind = config.kv_cache_dtype
        self.kv_format = kv_quant.KVCacheFormat(
            kind, dtype, self.spec.head_dim, kv_quant.row_align(kind, device)
        )
        self.max_blocks_per_seq = cdiv(max_model_len, self.block_size)
        # what the projections run: "none" (float), "int4", "int8" or "mixed" ([engine] quantization)
        self.model, self.quantization = build_model(
            config, self.spec, hf_config, model_dir, gguf_path, device, dtype, max_model_len
        )
        # LoRA adapters' slots beside every projection ([engine] max_loras; None = off)
        self.loras: LoRASlots | None = lora_slots_for(
            config, self.model, self.spec, Path(model_dir or "").name
        )
        self.window_everywhere, self.sinks = self.spec.window_everywhere, 0
        # Gemma 2's capped attention scores: the torch path's unfused attention only (layers/softcap.py)
        self.softcapped = any(m.softcap for m in self.model.modules() if isinstance(m, PagedAttention))
        check_h2o(config, self.spec.sliding_windows, self.softcapped)
        # H2O: attention on the scored torch path (no fused kernel forms the weights); its sinks are
        # tokens it never drops, not StreamingLLM's window
        self.scores_keys = config.kv_eviction == "h2o"
        if self.scores_keys and (config.compile != "off" or device.type == "cuda"):
            log.info("kv_eviction h2o: attention on the scored torch path (no compiled decode, no Triton)")
        if config.attention_sinks and not self.scores_keys:
            self._use_sinks(config.attention_sinks, context or max_model_len)
        # Soft-capped scores, attention sinks, H2O's scores and latent attention: the torch path only.
        torch_only = (
            "the Triton kernels cannot soft-cap attention scores"
            if self.softcapped
            else "attention sinks, H2O or latent attention"
            if self.sinks or self.scores_keys or self.spec.kv_parts != 2
            else None
        )
        self.attention_backend = gpu_kernels.choose_attention(
            self.model, device, dtype, self.spec, self.block_size, self.kv_format.storage_dtype, torch_only
        )
        # CUDA: norms, rotary and SiLU as one Triton kernel each (about 40 fewer launches a layer)
        self.fused_elementwise = gpu_kernels.enable_fused(self.model, device, dtype)
        self.num_blocks = self._num_kv_blocks()
        # Decode-only steps in one call into cachegw's kernels where the model allows: nothing to compile.
        plain = not (self.sinks or self.scores_keys or self.loras)
        kv_dtype = self.kv_format.storage_dtype
        self.fused = fused_decode_for(config, device, self.model, kv_dtype, native) if plain else None
        # CPU only: CUDA has its Triton kernels and CUDA graphs; attention sinks keep the eager path.
        compiling = (
            device.type == "cpu"
            and not (self.sinks or self.scores_keys or self.fused)
            and self.spec.decode_compiles
            and will_compile(config.compile)
        )
        # With a compiled decode step, one more block than the block manager hands out: the
        # compile's warm-up writes there while sequences may already be running.
        self.kv_caches = self._allocate_kv_cache(self.num_blocks + compiling)
        self.compiled: CompiledDecode | None = None
        # the compiled decode step's attention on cachegw's kernel (float32 or int8 caches)
        self.native_decode: str | None = None  # its op namespace
        if compiling:
            head_dim = self.spec.head_dim
            fits = (
                self.spec.kv_parts == 2  # cachegw's kernel reads per-head K and V
                and not self.softcapped
                and dtype == torch.float32
                and self.kv_caches[0][0].dtype in (torch.float32, torch.int8)
                and head_dim % 16 == 0
                and head_dim <= 256
            )
            self.native_decode = native if fits else None
            for module in self.model.modules():
                if isinstance(module, PagedAttention):
                    module.native_decode = self.native_decode
            self.compiled = start_compiling(self.model, self.block_size, self.num_blocks, config.compile)
        self.graphs: DecodeGraphs | None = None
        if self.attention_backend == "triton" and not config.enforce_eager:
            try:
                self.graphs = DecodeGraphs(
                    self.model,
                    config.max_num_seqs,
                    self.max_blocks_per_seq,
                    max_model_len,
                    self.spec.hidden_size,
                    dtype,
                    device,
                )
            except Exception:  # a driver or capture problem must not keep the engine from serving
                log.exception("CUDA graph capture failed: running decode eagerly")

    def _use_sinks(self, sinks: int, context: int) -> None:
        """StreamingLLM: each layer keeps ``sinks`` first positions and a window that fits the rest
        of the context (or its own window, if smaller): ``layers/sinks.py``."""
        if self.softcapped:
            raise ValueError("attention_sinks cannot run a model that soft-caps attention scores (Gemma 2)")
        if sinks >= context:
            raise ValueError(f"attention_sinks={sinks} leaves no window in a context of {context}")
        windows = []
        for layer in self.model.layers:
            attn = layer.self_attn.attn
            assert isinstance(attn, PagedAttention)
            attn.sinks = sinks
            attn.sliding_window = min(attn.sliding_window or context, context - sinks)
            windows.append(attn.sliding_window)
        self.window_everywhere = windows[0] if len(set(windows)) == 1 else None
        self.sinks = sinks

    @property
    def kv_bytes_per_token(self) -> int:
        return self.spec.kv_bytes_per_token(self.dtype, self.kv_format.kind, self.kv_format.align)

    def _num_kv_blocks(self) -> int:
        cfg, per_block = self.config, self.kv_bytes_per_token * self.block_size
        if cfg.kv_cache_tokens:
            return max(1, cfg.kv_cache_tokens // self.block_size)
        if self.device.type != "cuda":
            return max(1, cfg.kv_cache_bytes // per_block)
        # CUDA: what the weights and a full-size step's activations leave of the allowed fraction.
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._warmup_forward()
        free, total = torch.cuda.mem_get_info(self.device)
        used_now = total - free
        activation_peak = torch.cuda.max_memory_allocated(self.device) - torch.cuda.memory_allocated(
            self.device
        )
        budget = total * cfg.gpu_memory_utilization - used_now - activation_peak
        if budget < per_block:
            raise RuntimeError("no GPU memory left for the KV cache: raise gpu_memory_utilization")
        return int(budget // per_block)

    def _warmup_forward(self) -> None:
        n = min(self.config.max_num_batched_tokens, self.max_model_len)
        blocks = cdiv(n, self.block_size)
        self.kv_caches = self._allocate_kv_cache(blocks)
        meta = AttentionMetadata.one_prefill(n, self.block_size, self.device)
        with torch.inference_mode():
            ids = torch.zeros(n, dtype=torch.long, device=self.device)
            self.model.compute_logits(self.model(ids, torch.arange(n, device=self.device), meta)[-1:])
        self.kv_caches = []
        torch.cuda.empty_cache()

    def _allocate_kv_cache(self, num_blocks: int) -> list[tuple[torch.Tensor, ...]]:
        """Per layer ``spec.kv_parts`` tensors: K and V, or one latent cache (``layers/mla_attention.py``)."""
        s, fmt = self.spec, self.kv_format
        shape = (num_blocks, self.block_size, s.num_kv_heads)
        # zeros, not empty: attention multiplies masked-out slots by 0, and 0 x NaN would be NaN.
        # On CPU a page of the pool takes memory when first written (host_memory.py).
        caches = [
            tuple(fmt.allocate(shape, self.device) for _ in range(s.kv_parts)) for _ in range(s.num_layers)
        ]
        for layer, parts in zip(self.model.layers, caches, strict=True):
            attn = layer.self_attn.attn
            attn.k_cache, attn.v_cache = parts if len(parts) == 2 else (parts[0], torch.empty(0))
        return caches

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts, seq_lens, query_lens = [0], [], []
        sample_rows: list[int] = []
        sample_seqs: list[int] = []
        prompt_rows: dict[int, tuple[list[int], int]] = {}
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens, strict=True)):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            ids.extend((seq.token_ids + seq.draft if seq.draft else seq.token_ids)[start:end])
            positions.extend(range(start, end))
            table, gone = seq.block_table, seq.kv_dropped  # H2O: slot of position p is p - gone
            slots.extend(table[p // bs] * bs + p % bs for p in range(start - gone, end - gone))
            starts.append(starts[-1] + n)
            seq_lens.append(end - gone)
            query_lens.append(n)
            scored_end = min(end, seq.num_prompt_tokens - 1)
            if seq.needs_prompt_logprobs and scored_end > start:
                prompt_rows[i] = (list(range(starts[-1] - n, starts[-1] - n + scored_end - start)), start)
            if end == seq.num_tokens + len(seq.draft):  # the last token, and each draft token
                sample_rows.extend(range(starts[-1] - 1 - len(seq.draft), starts[-1]))
                sample_seqs.extend([i] * (1 + len(seq.draft)))
        width = max(len(s.block_table) for s in batch.seqs)
        # Entries of blocks freed before a sliding window (FREED, never read) point at block 0.
        tables = [
            (s.block_table if min(s.block_table) != FREED else [max(b, 0) for b in s.block_table])
            + [0] * (width - len(s.block_table))
            for s in batch.seqs
        ]
        dev = self.device

        def tensor(data, dtype):
            return torch.tensor(data, dtype=dtype, device=dev)

        meta = AttentionMetadata(
            slot_mapping=tensor(slots, torch.long),
            query_start_loc=tensor(starts, torch.int32),
            seq_lens=tensor(seq_lens, torch.int32),
            block_tables=tensor(tables, torch.int32),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            num_decodes=sum(1 for n in query_lens if n == 1),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            key_mass=torch.zeros(len(seq_lens), max(seq_lens), device=dev) if self.scores_keys else None,
        )
        return StepInputs(
            tensor(ids, torch.long),
            tensor(positions, torch.long),
            meta,
            tensor(sample_rows, torch.long),
            sample_seqs,
            {i: (tensor(rows, torch.long), first) for i, (rows, first) in prompt_rows.items()},
        )

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepOutput:
        """Logits of the sequences that sample; hidden states of the prompt positions that are scored
        (requests asking for prompt logprobs only: the others pay nothing)."""
        if self.loras is None:
            return self._execute(batch, False)
        try:  # a step with an adapter in it runs eagerly: the graphs were made without LoRA deltas
            return self._execute(batch, self.loras.set_batch(batch.seqs, batch.num_tokens))
        finally:
            self.loras.set_batch([], [])  # other forwards (embeddings) run the base

    def _execute(self, batch: ScheduledBatch, lora: bool) -> StepOutput:
        inputs = self.prepare(batch)
        n = len(batch.seqs)
        graph_size = self.graphs.size_for(n) if self.graphs is not None else None
        if (
            graph_size is not None
            and not lora
            and inputs.meta.max_query_len == 1
            and inputs.sample_seq_indices
            and not inputs.prompt_rows
        ):
            assert self.graphs is not None
            hidden = self.graphs.replay(graph_size, inputs)
            return StepOutput(self.model.compute_logits(hidden), inputs.sample_seq_indices, {})
        # The modules share the fused step's arithmetic (fused_decode.share_arithmetic), so a prefix
        # hit's last prompt token may run fused too: the same bits as in the prompt's prefill.
        decode_only = not lora and inputs.meta.max_query_len == 1 and not inputs.prompt_rows
        if self.fused is not None and decode_only and inputs.sample_seq_indices:
            fused_hidden = self.fused(inputs.input_ids, inputs.positions, inputs.meta)
            if fused_hidden is not None:  # None: it failed (logged), the modules run
                logits = self.model.compute_logits(fused_hidden[inputs.sample_indices])
                return StepOutput(logits, inputs.sample_seq_indices, {})
        if (
            self.compiled is not None
            and not lora
            and inputs.meta.max_query_len == 1
            and inputs.sample_seq_indices
            and not inputs.prompt_rows
            # torch's attention in the graph pads every decode to the longest context: then only a
            # batch that is one group (the eager path's groups of similar length, padding under
            # 25%); cachegw's kernel reads each sequence's own length, so any decode batch
            and (self.native_decode or len(inputs.meta.groups()) == 1)
        ):
            compiled = self.compiled(inputs.input_ids, inputs.positions, inputs.meta)
            if compiled is not None:
                logits = self.model.compute_logits(compiled[inputs.sample_indices])
                return StepOutput(logits, inputs.sample_seq_indices, {})
        flat = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        prompt = {i: (first, flat[rows]) for i, (rows, first) in inputs.prompt_rows.items()}
        if not inputs.sample_seq_indices:
            return StepOutput(torch.empty(0, self.spec.vocab_size), [], prompt, inputs.meta.key_mass)
        logits = self.model.compute_logits(flat[inputs.sample_indices])
        return StepOutput(logits, inputs.sample_seq_indices, prompt, inputs.meta.key_mass)

    def check_lora(self, lora: LoRARef | None) -> None:
        """A request's adapter (None: the base) must be loaded; UnknownModel (a 404) if not."""
        if lora is not None:
            if self.loras is None:
                raise UnknownModel(lora.name)
            self.loras.check(lora)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of hidden states (the LM head alone)."""
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def copy_block(self, src: int, dst: int) -> None:
        """Copy one KV block in every layer (a forked sample's own copy of a shared partial block)."""
        for parts in self.kv_caches:
            for cache in parts:
                cache[dst].copy_(cache[src])

    @torch.inference_mode()
    def move_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy cache rows (flat slots ``block * block_size + offset``) from ``src`` to ``dst`` in every
        layer, every source read before any destination is written (H2O's compaction)."""
        src, dst = src.to(self.device), dst.to(self.device)
        for cache in (c for kv in self.kv_caches for c in kv):
            rows = kv_quant.indexable(cache).flatten(0, 1)
            rows.index_copy_(0, dst, rows.index_select(0, src))

    @torch.inference_mode()
    def read_block(self, block_id: int) -> torch.Tensor:
        """One block's K/V in every layer, on the host, as stored: [layers, kv_parts, block_size, kv_heads,
        row_width] (an int8 block carries its scales: ``kv_format``)."""
        return torch.stack([torch.stack([c[block_id] for c in parts]) for parts in self.kv_caches]).cpu()

    @torch.inference_mode()
    def write_block(self, block_id: int, data: torch.Tensor) -> None:
        """Put a block read by ``read_block`` (here or in an earlier run) back into block ``block_id``."""
        data = data.to(self.device, non_blocking=True)
        for parts, layer in zip(self.kv_caches, data, strict=True):
            for cache, stored in zip(parts, layer, strict=True):
                cache[block_id].copy_(stored)
