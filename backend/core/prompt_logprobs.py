"""Prompt logprobs: what the model gave each prompt token, computed during prefill.

Only requests that ask (``echo`` with ``logprobs`` on /v1/completions, the loglikelihood scoring
of evaluation harnesses) send their prompt positions through the LM head; the others pay nothing.
The LM head runs in slices so a long prompt never holds [prompt, vocab] logits at once. Their OpenAI
shape (an echoed completion's ``logprobs``) is ``entrypoints/openai_mapping.py``'s.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from cachegw.backend.core.sequence import Sequence

LM_HEAD_ROWS = 256  # prompt positions per LM-head slice: 256 x 49k vocab x 4 bytes = 50 MB


def record(
    seq: Sequence, first: int, hidden: torch.Tensor, logits_of: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    """Append the logprobs that ``hidden`` (positions ``first``, ``first + 1``, ...) give the prompt
    tokens after them. Positions already recorded (a preempted sequence computes them again) are
    skipped, so each prompt token is scored once."""
    assert seq.prompt_logprobs is not None
    skip = len(seq.prompt_logprobs) - 1 - first
    if skip >= hidden.shape[0]:
        return
    hidden = hidden[max(skip, 0) :]
    start = first + max(skip, 0)
    k = seq.params.prompt_logprobs or 0
    for lo in range(0, hidden.shape[0], LM_HEAD_ROWS):
        lp = logits_of(hidden[lo : lo + LM_HEAD_ROWS]).log_softmax(dim=-1)
        targets = seq.token_ids[start + lo + 1 : start + lo + 1 + lp.shape[0]]
        chosen = lp.gather(1, torch.tensor(targets, device=lp.device)[:, None])[:, 0].tolist()
        tops = lp.topk(k) if k else None
        for j, token in enumerate(targets):
            top = list(zip(tops.indices[j].tolist(), tops.values[j].tolist(), strict=True)) if tops else []
            seq.prompt_logprobs.append({"token_id": token, "logprob": chosen[j], "top": top})
