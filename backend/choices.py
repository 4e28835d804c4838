"""The pieces of a response with several choices (n > 1, best_of) and echo: what each choice of a
stream has sent so far, and the echoed prompt of a completion."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from backend.outputs import CompletionOutput, RequestOutput
from backend.prompt_logprobs import echo_logprobs, join_logprobs
from backend.protocol import TokenTexts, completion_logprobs


@dataclass
class Cursor:
    """How much of one choice a stream has sent: text, tokens (for logprobs), whether it finished."""

    chars: int = 0
    tokens: int = 0
    offset: int = 0  # text offset of the next token's logprobs (completions)
    started: bool = False
    done: bool = False

    def advance(self, c: CompletionOutput) -> tuple[str, list[dict] | None]:
        """The new text and the new tokens' logprob entries (None when none were asked for)."""
        delta, self.chars = c.text[self.chars :], max(self.chars, len(c.text))
        entries = c.logprobs[self.tokens :] if c.logprobs is not None else None
        self.tokens = len(c.token_ids)
        return delta, entries


class Cursors(dict[int, Cursor]):
    """One cursor per choice index, made when the choice first shows up."""

    def __missing__(self, index: int) -> Cursor:
        cursor = self[index] = Cursor()
        return cursor


@dataclass(frozen=True)
class Echo:
    """``echo: true`` on /v1/completions: the prompt comes back before each choice's text."""

    text: str
    logprobs: bool  # with ``logprobs``: the prompt tokens' too (the first one null, as OpenAI)

    def head(self, out: RequestOutput, texts: TokenTexts) -> dict[str, Any] | None:
        if not self.logprobs or out.prompt_logprobs is None:
            return None
        return echo_logprobs(out.prompt_token_ids, out.prompt_logprobs, texts)[0]


def text_logprobs(
    c: CompletionOutput, out: RequestOutput, texts: TokenTexts, echo: Echo | None
) -> dict[str, Any] | None:
    """A completion choice's whole ``logprobs``: the echoed prompt's, then its own tokens', with
    text offsets into the returned text."""
    own = None
    if c.logprobs is not None:
        own = completion_logprobs(c.logprobs, texts, len(echo.text) if echo else 0)[0]
    head = echo.head(out, texts) if echo else None
    return own if head is None else join_logprobs(head, own)
