"""Which draft tokens the model would have produced itself (speculative decoding's verification).

The runner scores a sequence's last token and its k draft tokens in one pass, so logits row j is
the next-token distribution after the draft's first j tokens. Each row gets what a plain decode
step applies there: penalties counting the draft tokens before it, logit_bias, temperature,
top-k/top-p (``backend/executor/sampler.py``). Greedy rows accept a draft token while it is the row's
argmax, and the first row that disagrees gives its argmax: the output is plain decoding's, token
for token. Sampled rows treat the draft as a point mass: token t is accepted with probability
p(t), else the row draws from p with t removed and renormalized. Then every emitted token is
distributed as p: t with p(t), any other x with (1 - p(t)) * p(x) / (1 - p(t)) = p(x). With all k
accepted the last row gives one more token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cachegw.backend.core.sampling_params import SamplingParams
from cachegw.backend.core.sequence import Sequence
from cachegw.backend.executor.sampler import apply_penalties, logprob_entry, probabilities


@dataclass
class Verified:
    token_ids: list[int]  # the accepted draft tokens, then the model's own next one
    logprobs: list[dict | None]
    accepted: int  # how many of the draft's tokens were accepted


@dataclass(frozen=True)
class _Ahead:
    """The sequence as the penalties see it once a prefix of the draft is accepted."""

    params: SamplingParams
    output_token_ids: list[int]

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


@torch.inference_mode()
def verify(
    logits: torch.Tensor, seq: Sequence, draft: list[int], default_generator: torch.Generator
) -> Verified:
    """``logits`` [len(draft) + 1, V] float32 (changed in place by penalties)."""
    p, k = seq.params, len(draft)
    want = p.logprobs is not None or p.best_of_ranks
    lp = logits.log_softmax(dim=-1) if want else None  # the model's own, before penalties
    if p.penalized:
        out = seq.output_token_ids
        apply_penalties(logits, [_Ahead(p, out + draft[:j]) for j in range(k + 1)])
    if p.greedy:
        targets = logits.argmax(dim=-1).tolist()
        a = 0
        while a < k and draft[a] == targets[a]:
            a += 1
        tokens = draft[:a] + [targets[a]]
    else:
        tokens = _rejection_sample(
            probabilities(logits, [p] * (k + 1)), draft, seq.generator or default_generator
        )
        a = len(tokens) - 1
    logprobs: list[dict | None] = (
        [logprob_entry(lp[j], t, p.logprobs or 0) for j, t in enumerate(tokens)]
        if lp is not None
        else [None] * len(tokens)
    )
    return Verified(tokens, logprobs, a)


def _rejection_sample(probs: torch.Tensor, draft: list[int], gen: torch.Generator) -> list[int]:
    """The accepted prefix of ``draft`` and one token drawn after it; probs [len(draft) + 1, V]."""
    for j, t in enumerate(draft):
        u = float(torch.rand(1, generator=gen, device=gen.device))
        if u < float(probs[j, t]):
            continue
        residual = probs[j].clone()
        residual[t] = 0.0
        if float(residual.sum()) <= 0.0:  # p(t) rounded to 1: nothing else can be drawn
            continue
        return draft[:j] + [int(torch.multinomial(residual, 1, generator=gen)[0])]
    return draft + [int(torch.multinomial(probs[len(draft)], 1, generator=gen)[0])]
