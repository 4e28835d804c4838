"""What the engine hands out: a request's state (the vLLM-shaped RequestOutput, built from its
samples by ``request_output``) and a snapshot of the engine's counters (``EngineStats``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cachegw.backend.core.kv_tier import TierStats
from cachegw.backend.core.swap import SwapCounts

if TYPE_CHECKING:
    from cachegw.backend.core.sequence import SequenceGroup


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list[dict] | None = None  # per token: {"token_id", "logprob", "top": [(id, logprob)]}
    cumulative_logprob: float = 0.0  # of the sampled tokens (computed when logprobs or best_of ask)


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finish_time: float | None
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    num_cached_tokens: int
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(repr=False, default=None)  # type: ignore[assignment]
    # Per prompt token (the first is None), when the request asked for prompt logprobs.
    prompt_logprobs: list[dict | None] | None = None
    num_generated_tokens: int = 0  # every sample's tokens, best_of's discarded ones included
    num_pinned_tokens: int = 0  # prompt tokens held by pins after this request (backend/core/pins.py)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    spec_decode_draft_tokens: int
    spec_decode_accepted_tokens: int
    compiled_decode_steps: int = (
        0  # decode steps the compiled graph ran (backend/executor/compiled_decode.py)
    )
    prefix_cache_hits_by_tier: dict[str, int] = field(default_factory=dict)  # tokens: pool, ram, disk, redis
    kv_tier: TierStats = field(default_factory=lambda: TierStats({}, {}, {}, {}))
    pinned_blocks: dict[str, int] = field(default_factory=dict)  # blocks held by pins: pool, tier
    swap: SwapCounts = field(default_factory=SwapCounts)  # [engine] preemption_mode swap/auto


def request_output(group: SequenceGroup) -> RequestOutput:
    """The request's state: one completion per returned sample, indexed as OpenAI does."""
    seq, finished = group.first, group.finished
    shown = group.returned()
    if seq.params.max_tokens == 0:  # nothing was sampled, so nothing forked: n equal answers
        shown = [seq] * seq.params.n
    completions = [
        CompletionOutput(
            index=k,
            text=s.detokenizer.visible_text(s.finish_reason is not None),
            token_ids=s.output_token_ids,
            finish_reason=s.finish_reason,
            stop_reason=s.stop_reason,
            logprobs=list(s.logprobs) if s.params.logprobs is not None else None,
            cumulative_logprob=s.cumulative_logprob,
        )
        for k, s in enumerate(shown)
    ]
    finish_times = [s.finish_time for s in group.seqs if s.finish_time is not None]
    metrics = RequestMetrics(
        seq.arrival_time,
        seq.first_scheduled_time,
        seq.first_token_time,
        max(finish_times) if finished and finish_times else None,
        sum(s.num_preemptions for s in group.seqs),
    )
    return RequestOutput(
        seq.request_id,
        seq.prompt,
        seq.token_ids[: seq.num_prompt_tokens],
        max(seq.num_cached_tokens, 0),
        completions,
        finished,
        metrics,
        prompt_logprobs=list(seq.prompt_logprobs) if seq.prompt_logprobs is not None else None,
        num_generated_tokens=sum(s.num_output_tokens for s in group.seqs),
        num_pinned_tokens=max(seq.num_pinned_tokens, 0),
    )
