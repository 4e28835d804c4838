"""Responses with several choices (n > 1, best_of) and echo: what each choice of a stream has sent
so far, the echoed prompt of a completion, and the shapers that turn engine outputs into OpenAI
responses and chunks (the chat shaper, with its tool calls, is ``chat_shaper.py``)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cachegw.backend.core.outputs import CompletionOutput, RequestOutput
from cachegw.backend.entrypoints.openai_mapping import (
    TokenTexts,
    completion_logprobs,
    echo_logprobs,
    join_logprobs,
    usage,
)

if TYPE_CHECKING:
    from cachegw.backend.core.async_engine import RequestStream


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


class Shaper:
    """Turns a request's outputs into one OpenAI response or its stream of chunks."""

    object_name = ""

    def __init__(self, request_id: str, model: str, texts: TokenTexts, include_usage: bool) -> None:
        self.id, self.model, self.texts, self.include_usage = request_id, model, texts, include_usage
        self.created = int(time.time())

    def envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        body = self.envelope(self.object_name, [choice])
        if self.include_usage:
            body["usage"] = None  # as OpenAI: every chunk but the last carries a null usage
        return body

    def usage_chunk(self, out: RequestOutput) -> dict[str, Any]:
        return {**self.envelope(self.object_name, []), "usage": usage(out)}


class CompletionShaper(Shaper):
    object_name = "text_completion"

    def __init__(
        self, request_id: str, model: str, texts: TokenTexts, include_usage: bool, echo: Echo | None = None
    ) -> None:
        super().__init__(request_id, model, texts, include_usage)
        self.echo = echo

    def response(self, out: RequestOutput) -> dict[str, Any]:
        prefix = self.echo.text if self.echo else ""
        choices = [
            {"index": c.index, "text": prefix + c.text, "finish_reason": c.finish_reason,
             "logprobs": text_logprobs(c, out, self.texts, self.echo)}
            for c in out.outputs
        ]  # fmt: skip
        return {**self.envelope("text_completion", choices), "usage": usage(out)}

    def text_chunk(self, index: int, text: str, logprobs: dict | None, finish: str | None = None) -> dict:
        return self.chunk({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish})

    async def chunks(self, stream: RequestStream) -> AsyncIterator[dict[str, Any]]:
        cursors = Cursors()
        async for out in stream:
            for c in out.outputs:
                cursor = cursors[c.index]
                if not cursor.started:
                    cursor.started = True
                    if self.echo is not None:  # the prompt first, then the choice's own tokens
                        cursor.offset = len(self.echo.text)
                        yield self.text_chunk(c.index, self.echo.text, self.echo.head(out, self.texts))
                if cursor.done:
                    continue
                delta, entries = cursor.advance(c)
                logprobs = None
                if entries:
                    logprobs, cursor.offset = completion_logprobs(entries, self.texts, cursor.offset)
                if delta or logprobs:
                    yield self.text_chunk(c.index, delta, logprobs)
                if c.finish_reason is not None:
                    cursor.done = True
                    yield self.text_chunk(c.index, "", None, c.finish_reason)
            if out.finished and self.include_usage:
                yield self.usage_chunk(out)
