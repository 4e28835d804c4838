"""Turns logits into the next token of each sequence.

Greedy rows take the argmax. Other rows apply temperature, top-k and top-p, then draw with the
request's own generator when it brought a seed, so a seeded request gives the same tokens
whatever else shares its batch. A row whose request asked for structured output first has the
tokens its grammar forbids masked out (``backend/structured.py``). Log-probabilities are those of
the model's distribution (before temperature and before the grammar's mask), as OpenAI reports them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backend.sequence import Sequence
from backend.structured import apply_grammar_masks


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


def sample(logits: torch.Tensor, seqs: list[Sequence], default_generator: torch.Generator) -> SampleResult:
    """One token for each row of ``logits`` [R, V] (float32); row i belongs to seqs[i].

    ``logits`` is changed in place where a row has a grammar.
    """
    want = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    lp = logits[want].log_softmax(dim=-1) if want else None  # the model's own, before any mask
    if any(s.grammar is not None for s in seqs):
        apply_grammar_masks(logits, [s.grammar for s in seqs])
    tokens = logits.argmax(dim=-1)
    random_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if random_rows:
        rows = torch.tensor(random_rows, device=logits.device)
        sub = (
            logits[rows]
            / torch.tensor([seqs[i].params.temperature for i in random_rows], device=logits.device)[:, None]
        )
        top_k = torch.tensor([seqs[i].params.top_k for i in random_rows], device=logits.device)
        top_p = torch.tensor([seqs[i].params.top_p for i in random_rows], device=logits.device)
        if bool((top_k > 0).any()) or bool((top_p < 1).any()):
            sub = _filter_top_k_top_p(sub, top_k, top_p)
        probs = sub.softmax(dim=-1)
        for j, i in enumerate(random_rows):
            gen = seqs[i].generator or default_generator
            tokens[i] = torch.multinomial(probs[j], 1, generator=gen)[0]
    token_list = tokens.tolist()
    logprobs: list[dict | None] = [None] * len(seqs)
    if lp is not None:
        for j, i in enumerate(want):
            k = seqs[i].params.logprobs or 0
            entry: dict = {"token_id": token_list[i], "logprob": float(lp[j, token_list[i]]), "top": []}
            if k:
                values, ids = lp[j].topk(k)
                entry["top"] = list(zip(ids.tolist(), values.tolist(), strict=True))
            logprobs[i] = entry
    return SampleResult(token_list, logprobs)
