"""What the engine returns for a request: the vLLM-shaped RequestOutput."""

from __future__ import annotations

from dataclasses import dataclass, field


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
