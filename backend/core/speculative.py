"""Draft tokens for speculative decoding, proposed without a draft model.

A decoding sequence whose text repeats what it has already seen (a summary quoting its document,
edited code, an answer from a given passage) can guess its next tokens: find the latest earlier
occurrence of its last n tokens and propose the k tokens that followed (prompt lookup). A request
may also bring a draft continuation of its own (``cachegw_draft``: the gateway sends the stored
answer of a near miss it refused); that draft is asked first, aligned with what was generated so
far, and the sequence's own text after it. The engine verifies the proposal in one forward pass
(``backend/core/spec_verify.py``), so a wrong guess costs time, never output.
"""

from __future__ import annotations

from dataclasses import dataclass

from cachegw.backend.config import EngineConfig


class NgramIndex:
    """Where each n-gram (n_min..n_max tokens) of a growing token list last ended, updated
    incrementally: each new token costs n_max dictionary writes, a lookup n_max reads."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self._last: dict[tuple[int, ...], int] = {}  # n-gram -> index just past its latest occurrence
        self._indexed = 0  # tokens[:_indexed] have every n-gram ending in them recorded

    def extend(self, tokens: list[int], upto: int) -> None:
        """Record the n-grams that end before ``upto``."""
        for end in range(self._indexed + 1, upto + 1):
            for n in range(self.n_min, min(self.n_max, end) + 1):
                self._last[tuple(tokens[end - n : end])] = end
        self._indexed = max(self._indexed, upto)

    def find(self, suffix: list[int]) -> int | None:
        """Where the latest indexed occurrence of the longest tail of ``suffix`` (n_max tokens down to
        n_min) that occurs at all ends; None when none does."""
        for n in range(min(self.n_max, len(suffix)), self.n_min - 1, -1):
            end = self._last.get(tuple(suffix[len(suffix) - n :]))
            if end is not None:
                return end
        return None


class DraftSource:
    """One sequence's proposals: its request's draft first (where the output still follows it,
    else where its last tokens occur in it), then prompt lookup over its own tokens."""

    def __init__(self, k: int, n_min: int, n_max: int, draft: list[int] | None = None) -> None:
        self.k = k
        self.drafted = self.accepted = 0  # this sequence's draft tokens scored, and accepted
        self.own = NgramIndex(n_min, n_max)
        self.draft = draft or []
        self.in_draft = NgramIndex(n_min, n_max)
        self.in_draft.extend(self.draft, len(self.draft))

    def record(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted

    def propose(self, tokens: list[int], num_prompt: int, room: int) -> list[int]:
        """Up to ``k`` (and ``room``) tokens likely to follow ``tokens`` (prompt then output)."""
        k = min(self.k, room)
        if k <= 0:
            return []
        if self.draft:
            out = tokens[num_prompt:]
            if self.draft[: len(out)] == out and len(out) < len(self.draft):
                return self.draft[len(out) : len(out) + k]
            end = self.in_draft.find(out)
            if end is not None and end < len(self.draft):
                return self.draft[end : end + k]
        # Every n-gram ending before the last token: the suffix's own occurrence never matches.
        self.own.extend(tokens, len(tokens) - 1)
        end = self.own.find(tokens)
        if end is None:
            return []
        # What followed, continued with the same period where it runs into the end ("a b a b a b").
        period = len(tokens) - end
        return [tokens[end + j % period] for j in range(k)]


@dataclass(frozen=True)
class Speculator:
    """``[engine] speculative = "ngram"``: how many tokens to draft and the n-gram sizes looked up."""

    num_tokens: int
    ngram_min: int
    ngram_max: int

    @classmethod
    def configured(cls, config: EngineConfig) -> Speculator | None:
        if config.speculative == "off":
            return None
        return cls(config.num_speculative_tokens, config.speculative_ngram_min, config.speculative_ngram_max)

    def source(self, draft: list[int] | None = None) -> DraftSource:
        return DraftSource(self.num_tokens, self.ngram_min, self.ngram_max, draft)
