"""Turns logits into the next token of each sequence.

Rows that ask for them first get presence/frequency penalties and logit_bias
(``apply_penalties``; a batch without any pays nothing). Greedy rows take the argmax. Other rows
apply temperature, top-k and top-p, then draw with the request's own generator when it brought a
seed, so a seeded request gives the same tokens whatever else shares its batch. A row whose
request asked for structured output first has the tokens its grammar forbids masked out
(``backend/core/structured.py``). Log-probabilities are those of the model's distribution (before
penalties, temperature and the grammar's mask), as OpenAI reports them.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol

import torch

from cachegw.backend.core.sampling_params import SamplingParams
from cachegw.backend.core.sequence import Sequence
from cachegw.backend.core.structured import apply_grammar_masks


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[dict | None]  # {"token_id", "logprob", "top": [(token_id, logprob), ...]}


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits outside each row's top-k and top-p nucleus to -inf. logits [R, V]."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    drop = ranks >= k[:, None]
    probs = sorted_logits.softmax(dim=-1)
    # Keep a token while the mass before it is below top_p: the top token always stays.
    drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    drop[:, 0] = False  # a top_p that rounds to 0 in float32 (1e-50) must not drop every token
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


class Generated(Protocol):
    """What the penalties read of a sequence (``Sequence``, or a view of it with draft tokens added)."""

    @property
    def params(self) -> SamplingParams: ...

    @property
    def output_token_ids(self) -> list[int]: ...

    @property
    def num_output_tokens(self) -> int: ...


@torch.inference_mode()
def apply_penalties(logits: torch.Tensor, seqs: Seq[Generated]) -> None:
    """OpenAI's penalties and logit_bias, in place, on the rows that ask for them:
    ``logit[j] -= count[j] * frequency_penalty + (count[j] > 0) * presence_penalty`` over the
    tokens this sample generated so far, then ``logit[j] += logit_bias[j]``."""
    vocab = logits.shape[-1]
    for i, s in enumerate(seqs):
        p = s.params
        row = logits[i]
        if (p.frequency_penalty or p.presence_penalty) and s.num_output_tokens:
            out = torch.tensor(s.output_token_ids, device=logits.device)
            counts = torch.bincount(out, minlength=vocab)[:vocab].to(row.dtype)
            row -= counts * p.frequency_penalty + (counts > 0).to(row.dtype) * p.presence_penalty
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=logits.device)
            row.index_add_(
                0, ids, torch.tensor(list(p.logit_bias.values()), dtype=row.dtype, device=logits.device)
            )


def sample(logits: torch.Tensor, seqs: list[Sequence], default_generator: torch.Generator) -> SampleResult:
    """One token for each row of ``logits`` [R, V] (float32); row i belongs to seqs[i].

    ``logits`` is changed in place where a row has a grammar.
    """
    # best_of ranks its samples by cumulative logprob, so those rows need the chosen token's too.
    want = [i for i, s in enumerate(seqs) if s.params.logprobs is not None or s.params.best_of_ranks]
    lp = logits[want].log_softmax(dim=-1) if want else None  # the model's own, before any mask
    if any(s.params.penalized for s in seqs):
        apply_penalties(logits, seqs)
    if any(s.grammar is not None for s in seqs):
        apply_grammar_masks(logits, [s.grammar for s in seqs])
    tokens = logits.argmax(dim=-1)
    random_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if random_rows:
        probs = probabilities(logits[random_rows], [seqs[i].params for i in random_rows])
        for j, i in enumerate(random_rows):
            gen = seqs[i].generator or default_generator
            tokens[i] = torch.multinomial(probs[j], 1, generator=gen)[0]
    token_list = tokens.tolist()
    logprobs: list[dict | None] = [None] * len(seqs)
    if lp is not None:
        for j, i in enumerate(want):
            logprobs[i] = logprob_entry(lp[j], token_list[i], seqs[i].params.logprobs or 0)
    return SampleResult(token_list, logprobs)


def probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each (non-greedy) row draws from: temperature, then top-k and top-p."""
    dev = logits.device
    sub = logits / torch.tensor([p.temperature for p in params], device=dev)[:, None]
    top_k = torch.tensor([p.top_k for p in params], device=dev)
    top_p = torch.tensor([p.top_p for p in params], device=dev)
    if bool((top_k > 0).any()) or bool((top_p < 1).any()):
        sub = _filter_top_k_top_p(sub, top_k, top_p)
    return sub.softmax(dim=-1)


def logprob_entry(lp: torch.Tensor, token: int, k: int) -> dict:
    """The chosen token's logprob and the ``k`` most likely, from one row of log-softmaxed logits."""
    entry: dict = {"token_id": token, "logprob": float(lp[token]), "top": []}
    if k:
        values, ids = lp.topk(k)
        entry["top"] = list(zip(ids.tolist(), values.tolist(), strict=True))
    return entry
