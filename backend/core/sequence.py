"""One request as the engine sees it: its tokens, its blocks, how far it has been computed."""

from __future__ import annotations

import time
from enum import Enum, auto

import torch

from cachegw.backend.core.detokenizer import IncrementalDetokenizer
from cachegw.backend.core.sampling_params import SamplingParams
from cachegw.backend.core.speculative import DraftSource
from cachegw.backend.core.structured import Grammar


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """Token ids (prompt, then generated), the block table, and per-request state.

    ``num_computed_tokens`` counts tokens whose K/V are in the cache. After a preemption it drops
    to 0 and the sequence (prompt and generated tokens alike) is computed again.
    """

    detokenizer: IncrementalDetokenizer  # set by the engine when it adds or forks the sequence

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        prompt: str | None = None,
        index: int = 0,
    ) -> None:
        self.request_id = request_id
        self.index = index  # which of the request's samples (n > 1 / best_of) this is
        self.prompt = prompt
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.cache_salt = cache_salt
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # chained hashes of the full blocks, computed lazily
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 until then
        self.num_pinned_tokens = -1  # prompt tokens its pins hold, once its prompt is computed
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.output_text = ""
        self.logprobs: list[dict] = []
        self.cumulative_logprob = 0.0  # of the sampled tokens: how best_of ranks the samples
        # Per prompt position, the logprob of that token given the ones before (None for the first).
        self.prompt_logprobs: list[dict | None] | None = (
            [None] if params.prompt_logprobs is not None else None
        )
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.generator: torch.Generator | None = None
        self.grammar: Grammar | None = None  # response_format's matcher, advanced by each output token
        self.spec: DraftSource | None = None  # proposes draft tokens when speculative decoding is on
        self.draft: list[int] = []  # this step's draft tokens, scored after the last token
        # H2O ([engine] kv_eviction): tokens whose K/V were dropped (the cache slot of position p is
        # p - kv_dropped) and the attention each cached slot has received (backend/core/h2o.py)
        self.kv_dropped = 0
        self.key_scores: torch.Tensor | None = None

    @property
    def needs_prompt_logprobs(self) -> bool:
        """True until every prompt position's logprob is known: until then no cached prefix is reused."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    def fork(self, index: int) -> Sequence:
        """A sibling sample at this point (prompt computed, nothing sampled yet): same tokens, same
        computed count, fresh per-sample state. The caller shares or copies the blocks."""
        child = Sequence(
            self.request_id,
            self.token_ids,
            self.params,
            self.cache_salt,
            self.arrival_time,
            self.prompt,
            index,
        )
        child.num_computed_tokens = self.num_computed_tokens
        child.block_hashes = list(self.block_hashes)
        child.num_cached_tokens = self.num_cached_tokens
        child.num_pinned_tokens = self.num_pinned_tokens
        child.first_scheduled_time = self.first_scheduled_time
        child.prompt_logprobs = self.prompt_logprobs  # complete and read-only by now: shared
        return child

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_cached_slots(self) -> int:
        """Tokens whose K/V are in the cache now: the computed ones less those H2O dropped."""
        return self.num_computed_tokens - self.kv_dropped

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
            f"blocks={self.block_table}, status={self.status.name})"
        )


class SequenceGroup:
    """One request's samples: a single sequence until its prompt is computed, then ``num_samples``
    forks of it sharing the prompt's blocks."""

    def __init__(self, seq: Sequence) -> None:
        self.seqs = [seq]
        self.forked = seq.params.num_samples == 1

    @property
    def first(self) -> Sequence:
        return self.seqs[0]

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)

    def returned(self) -> list[Sequence]:
        """The samples the answer shows, in index order: with best_of, once all are done, the n with
        the highest cumulative logprob (OpenAI's choice), re-indexed from 0."""
        p = self.first.params
        if p.num_samples == p.n or not self.finished:
            return self.seqs
        best = sorted(self.seqs, key=lambda s: -s.cumulative_logprob)[: p.n]
        return sorted(best, key=lambda s: s.index)
