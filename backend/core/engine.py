"""The engine loop: add requests, step, collect outputs.

A step is: schedule (which sequences, how many tokens each) -> run the model on the flat batch
-> mark the computed blocks findable for prefix caching -> sample one token for each sequence
that reached its end -> detokenize and check stop conditions -> free finished sequences.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch

from cachegw.backend.config import EngineConfig
from cachegw.backend.core.block_manager import BlockManager
from cachegw.backend.core.detokenizer import IncrementalDetokenizer
from cachegw.backend.core.eos import eos_token_ids
from cachegw.backend.core.h2o import h2o_for
from cachegw.backend.core.kv_tier import TierStats, offload_for
from cachegw.backend.core.kv_tier_events import events_for
from cachegw.backend.core.outputs import EngineStats, RequestOutput, request_output
from cachegw.backend.core.pins import PinTable
from cachegw.backend.core.prompt_logprobs import record as record_prompt_logprobs
from cachegw.backend.core.sampling_params import InvalidParameter, SamplingParams
from cachegw.backend.core.scheduler import Scheduler
from cachegw.backend.core.sequence import Sequence, SequenceGroup
from cachegw.backend.core.spec_verify import verify
from cachegw.backend.core.speculative import DraftSource, Speculator
from cachegw.backend.core.structured import GrammarCompiler
from cachegw.backend.core.swap import SwapCounts, swap_space_for
from cachegw.backend.core.tokenizer import open_tokenizer
from cachegw.backend.executor.model_config import read_model_config
from cachegw.backend.executor.model_loader import gguf_source, resolve_model_dir
from cachegw.backend.executor.model_runner import ModelRunner
from cachegw.backend.executor.model_weights import needs_weight_files
from cachegw.backend.executor.platform import block_weights, resolve_device, resolve_dtype
from cachegw.backend.executor.sampler import sample

log = logging.getLogger("cachegw.backend")


class ContextLengthExceeded(InvalidParameter):
    """The prompt (plus max_tokens) does not fit the model's context or the KV cache."""

    code = "context_length_exceeded"


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        start = time.perf_counter()
        self.config, self.device = config, resolve_device(config.device)
        gguf = gguf_source(config.model)
        kernels = block_weights(config, gguf, self.device)  # g++ may build them while the model dir is made
        weights = needs_weight_files(config, gguf, self.device)
        self.model_dir = resolve_model_dir(config.model, config.resolved_cache_dir, weights)
        self.dtype = resolve_dtype(config.dtype, self.device, kernels())
        hf_config = read_model_config(self.model_dir)  # no transformers where it can: model_config.py
        limit = hf_config.max_position_embeddings
        context = min(config.max_model_len, limit) if config.max_model_len else limit
        # With attention sinks a sequence may run past the context, up to streaming_max_len.
        self.max_model_len = max(context, config.streaming_max_len) if config.attention_sinks else context
        self.tokenizer = open_tokenizer(self.model_dir)  # None: prompts as token ids
        self.runner = ModelRunner(
            config,
            hf_config,
            self.model_dir,
            self.device,
            self.dtype,
            self.max_model_len,
            gguf_path=gguf,
            context=context,
        )
        self.kv_tier = offload_for(config, self.runner, self.model_dir, self.dtype)
        self.block_manager = BlockManager(
            self.runner.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            window=self.runner.window_everywhere,
            sinks=self.runner.sinks,
            tier=self.kv_tier,
            kv_budget=config.kv_budget_tokens if config.kv_eviction == "h2o" else 0,
            events=events_for(config, self.kv_tier),
        )
        self.h2o = h2o_for(config, self.block_manager, self.runner.move_rows)
        self.pins = PinTable(self.block_manager, int(config.pinned_kv_share * self.runner.num_blocks))
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            speculative_max_seqs=config.speculative_max_seqs,
            pins=self.pins,
            swap=swap_space_for(config, self.block_manager, self.runner.read_block, self.runner.write_block),
        )
        self.eos_token_ids = eos_token_ids(self.model_dir, hf_config, self.tokenizer)
        self.grammars = GrammarCompiler(
            self.tokenizer, self.runner.spec.vocab_size, self.eos_token_ids, config.grammar_cache_size
        )
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.requests: dict[str, SequenceGroup] = {}
        self.speculator = Speculator.configured(config)
        self.spec_draft_tokens = 0  # draft tokens scored
        self.spec_accepted_tokens = 0  # of those, accepted
        self.prompt_tokens = 0
        self.generation_tokens = 0
        log.info(
            "engine ready in %.1f s: %s on %s/%s, weights %s, %d KV blocks x %d tokens (%.0f MiB)",
            time.perf_counter() - start, self.model_dir.name, self.device, self.dtype,
            self.runner.quantization, self.runner.num_blocks, config.block_size, self.kv_cache_bytes / 2**20,
        )  # fmt: skip

    def close(self) -> None:
        """Write the pool's and RAM's blocks to the disk/Redis tier, most recent first, within
        ``kv_shutdown_budget_s``, so a restart finds them (a killed engine keeps what left before)."""
        if self.block_manager.events is not None:
            self.block_manager.events.close()
        if self.kv_tier is not None:
            self.kv_tier.persist(self.block_manager.hashed_by_recency(), self.config.kv_shutdown_budget_s)
            self.kv_tier.close()

    @property
    def kv_cache_bytes(self) -> int:
        return self.runner.num_blocks * self.config.block_size * self.runner.kv_bytes_per_token

    @property
    def kv_cache_tokens(self) -> int:
        return self.runner.num_blocks * self.config.block_size

    @property
    def longest_request(self) -> int:
        """Prompt + completion tokens one request may reach: the context, and the KV pool unless a
        window on every layer bounds what a sequence holds (``BlockManager.most_blocks_held``)."""
        if self.block_manager.window is not None or self.block_manager.kv_budget:
            return self.max_model_len
        return min(self.max_model_len, self.kv_cache_tokens)

    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidParameter("prompt", "this model has no tokenizer: send token ids")
        return self.tokenizer.encode(prompt, add_special_tokens=False)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> Sequence:
        """Queue a request; raises InvalidParameter (or ContextLengthExceeded) if it can never run."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        vocab = self.runner.spec.vocab_size
        if not ids:
            raise InvalidParameter("prompt", "the prompt is empty")
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in ids):
            raise InvalidParameter("prompt", f"token ids must be integers in [0, {vocab})")
        n, limit = len(ids), self.max_model_len
        if n >= limit or n + params.max_tokens > limit:
            raise ContextLengthExceeded(
                "max_tokens" if n < limit else "prompt",
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{n + params.max_tokens} tokens ({n} in the prompt, {params.max_tokens} for the "
                "completion). Please reduce the prompt or max_tokens.",
            )
        chunk = self.config.max_num_batched_tokens
        if self.block_manager.most_blocks_held(n + params.max_tokens, chunk) > self.block_manager.num_blocks:
            raise ContextLengthExceeded(
                "max_tokens" if n < self.kv_cache_tokens else "prompt",
                f"The request needs {n + params.max_tokens} tokens of KV cache but the engine holds "
                f"{self.kv_cache_tokens}. Please reduce the prompt or max_tokens.",
            )
        self._check_samples(params, vocab)
        self.runner.check_lora(params.lora)
        grammar = self.grammars.grammar(params.structured) if params.structured else None
        seq = Sequence(
            request_id, ids, params, cache_salt, arrival_time, prompt if isinstance(prompt, str) else None
        )
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer, params.stop, params.skip_special_tokens)
        seq.grammar = grammar
        seq.spec = self._draft_source(params)
        if params.seed is not None:
            seq.generator = torch.Generator(device=self.device).manual_seed(params.seed)
        self.requests[request_id] = SequenceGroup(seq)
        self.scheduler.add(seq)
        self.block_manager.prefetch(seq)
        return seq

    def _draft_source(self, params: SamplingParams) -> DraftSource | None:
        """Speculative decoding's proposer for a new sequence; none with a grammar (its matcher
        cannot take back a rejected token), so structured output and tool calls decode plainly."""
        if self.speculator is None or params.structured is not None:
            return None
        draft = self.tokenize(params.draft) if params.draft and self.tokenizer is not None else None
        return self.speculator.source(draft)

    def _check_samples(self, params: SamplingParams, vocab: int) -> None:
        """The limits only the engine knows: [engine] max_n, and the vocabulary for logit_bias."""
        for name in ("n", "best_of"):
            value = getattr(params, name)
            if value is not None and value > self.config.max_n:
                raise InvalidParameter(
                    name,
                    f"{name}={value} is more than this server allows ([engine] max_n = {self.config.max_n})",
                )
        bad = next((t for t in params.logit_bias if t >= vocab), None)
        if bad is not None:
            raise InvalidParameter(
                "logit_bias", f"logit_bias key {bad} is not a token id of this model (0 to {vocab - 1})"
            )

    def _fork(self, group: SequenceGroup, parent: Sequence) -> list[Sequence]:
        """All the request's samples, made from its parent whose prompt was just computed: they share
        its full prompt blocks and copy a partly filled last one. Without a free block or a batch
        slot a sample waits instead, and finds the prompt in the prefix cache when admitted."""
        group.forked = True
        p = parent.params
        for i in range(1, p.num_samples):
            child = parent.fork(i)
            child.detokenizer = IncrementalDetokenizer(self.tokenizer, p.stop, p.skip_special_tokens)
            child.grammar = parent.grammar.copy() if parent.grammar is not None else None
            child.spec = self._draft_source(p)
            if p.seed is not None:
                child.generator = torch.Generator(device=self.device).manual_seed(p.seed + i)
            if self.scheduler.has_room() and self.block_manager.can_fork(parent):
                copy = self.block_manager.fork(parent, child)
                if copy is not None:
                    self.runner.copy_block(*copy)
                self.scheduler.add_running(child)
            else:
                child.num_computed_tokens = 0
                self.scheduler.add(child)
            group.seqs.append(child)
        return list(group.seqs)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; False if it was unknown or already done."""
        group = self.requests.pop(request_id, None)
        if group is None:
            return False
        now = time.time()
        for seq in group.seqs:
            if seq.finish_reason is None:
                self.scheduler.finish(seq)
                seq.finish_reason, seq.finish_time = "abort", now
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns the outputs of the sequences that got a token (or finished)."""
        batch = self.scheduler.schedule()
        if not batch:
            return []
        step = self.runner.execute(batch)
        for i, (first, hidden) in step.prompt_hidden.items():
            record_prompt_logprobs(batch.seqs[i], first, hidden, self.runner.logits)
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
            n -= len(seq.draft)  # draft tokens count as computed only once accepted
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                self.prompt_tokens += min(n, seq.num_prompt_tokens - seq.num_computed_tokens)
            seq.num_computed_tokens += n
            self.block_manager.cache_computed_blocks(seq)
            self.pins.on_computed(seq)  # before the window frees any block of the prompt
            self.block_manager.free_outside_window(seq)
        if self.h2o is not None:  # the step's attention scores; sequences over the budget compacted
            self.h2o.after_step(batch.seqs, step.key_mass)
        now = time.time()
        touched: dict[str, SequenceGroup] = {}
        rows, sampled = [], []
        row = 0
        while row < len(step.rows):
            seq = batch.seqs[step.rows[row]]
            group = touched[seq.request_id] = self.requests[seq.request_id]
            if seq.draft:
                span = 1 + len(seq.draft)
                self._verify(seq, step.logits[row : row + span], now)
                row += span
                continue
            if seq.params.max_tokens == 0:  # echo scoring: the prompt alone
                seq.finish_reason = "length"
                self._finish(seq, group, now)
            else:
                siblings = [seq] if group.forked else self._fork(group, seq)
                rows += [row] * len(siblings)
                sampled += siblings
            row += 1
        if sampled:
            self._sample(
                step.logits[rows] if rows != list(range(len(step.rows))) else step.logits, sampled, now
            )
        return [request_output(g) for g in touched.values()]

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], now: float) -> None:
        result = sample(logits, seqs, self.generator)
        for seq, token, logprob in zip(seqs, result.token_ids, result.logprobs, strict=True):
            if self._append(seq, token, logprob, now):
                self._finish(seq, self.requests[seq.request_id], now)

    def _verify(self, seq: Sequence, logits: torch.Tensor, now: float) -> None:
        """Keep the draft tokens the model agrees with and its own next token (``spec_verify``);
        the rejected ones' KV slots are overwritten later, and blocks beyond the kept tokens go back."""
        draft, seq.draft = seq.draft, []
        result = verify(logits, seq, draft, self.generator)
        self.spec_draft_tokens += len(draft)
        self.spec_accepted_tokens += result.accepted
        seq.spec.record(len(draft), result.accepted)  # type: ignore[union-attr]  # drafts come from it
        kept = 0
        for token, logprob in zip(result.token_ids, result.logprobs, strict=True):
            kept += 1
            if self._append(seq, token, logprob, now):
                break
        seq.num_computed_tokens += min(kept, result.accepted)
        self.block_manager.cache_computed_blocks(seq)
        if seq.finish_reason is not None:
            self._finish(seq, self.requests[seq.request_id], now)
        else:
            self.block_manager.trim(seq)

    def _append(self, seq: Sequence, token: int, logprob: dict | None, now: float) -> bool:
        """Add one generated token; True when it ends the sequence."""
        seq.token_ids.append(token)
        self.generation_tokens += 1
        if seq.first_token_time is None:
            seq.first_token_time = now
        if logprob is not None:
            seq.cumulative_logprob += logprob["logprob"]
            if seq.params.logprobs is not None:
                seq.logprobs.append(logprob)
        self._check_stop(seq, token)
        return seq.finish_reason is not None

    def _finish(self, seq: Sequence, group: SequenceGroup, now: float) -> None:
        seq.finish_time = now
        if seq.spec is not None and seq.spec.drafted:
            log.info(
                "%s: %d of %d draft tokens accepted (%.0f%%), %d tokens generated",
                seq.request_id, seq.spec.accepted, seq.spec.drafted,
                100 * seq.spec.accepted / seq.spec.drafted, seq.num_output_tokens,
            )  # fmt: skip
        seq.detokenizer.flush()
        self.scheduler.finish(seq)
        if group.finished:
            del self.requests[seq.request_id]

    def _check_stop(self, seq: Sequence, token: int) -> None:
        p = seq.params
        if seq.grammar is not None and (not seq.grammar.accept(token) or seq.grammar.done):
            # The JSON is complete (or, should the mask ever fail, broken): nothing may follow.
            seq.finish_reason, seq.stop_reason = "stop", seq.detokenizer.add(token)
            return
        if token in p.stop_token_ids or (token in self.eos_token_ids and not p.ignore_eos):
            seq.finish_reason, seq.stop_reason = "stop", (None if token in self.eos_token_ids else token)
            return
        stop = seq.detokenizer.add(token)
        if stop is not None:
            seq.finish_reason, seq.stop_reason = "stop", stop
        elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"

    def _tier_stats(self) -> TierStats:
        """Blocks and bytes per tier: the pool's findable (hashed) blocks, then the offload tiers'."""
        pooled = len(self.block_manager.cached)
        per_block = self.config.block_size * self.runner.kv_bytes_per_token
        tiers = self.kv_tier.stats() if self.kv_tier is not None else TierStats({}, {}, {}, {})
        return replace(
            tiers,
            blocks={"pool": pooled, **tiers.blocks},
            bytes={"pool": pooled * per_block, **tiers.bytes},
        )

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=bm.usage,
            num_blocks=bm.num_blocks,
            prefix_cache_queries=bm.prefix_queries,
            prefix_cache_hits=bm.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            prefix_cache_hits_by_tier=dict(bm.hits_by_tier),
            kv_tier=self._tier_stats(),
            spec_decode_draft_tokens=self.spec_draft_tokens,
            spec_decode_accepted_tokens=self.spec_accepted_tokens,
            compiled_decode_steps=self.runner.compiled.steps if self.runner.compiled else 0,
            pinned_blocks={"pool": self.pins.num_pool_blocks, "tier": self.pins.num_tier_blocks},
            swap=replace(self.scheduler.swap.counts) if self.scheduler.swap else SwapCounts(),
        )
