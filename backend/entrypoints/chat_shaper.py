"""The chat completion shaper: engine outputs as a ``chat.completion`` or its chunks, with tool calls
(``tool_responses.py``), logprobs and the stop string that ended each choice."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from cachegw.backend.core.async_engine import RequestStream
from cachegw.backend.core.outputs import CompletionOutput, RequestOutput
from cachegw.backend.entrypoints.choices import Cursors, Shaper
from cachegw.backend.entrypoints.openai_mapping import TokenTexts, chat_logprobs, usage
from cachegw.backend.entrypoints.tool_responses import tool_chunks, tool_message
from cachegw.backend.entrypoints.tools import ToolRequest


class ChatShaper(Shaper):
    """Engine outputs as chat completions and their chunks, with tool calls and logprobs."""

    object_name = "chat.completion.chunk"

    def __init__(
        self, request_id: str, model: str, texts: TokenTexts, include_usage: bool, top: int | None,
        tools: ToolRequest | None = None,
    ) -> None:  # fmt: skip
        super().__init__(request_id, model, texts, include_usage)
        self.top = top  # None: no logprobs
        self.tools = tools  # the answer may be tool calls (backend/entrypoints/tool_responses.py)

    def logprobs(self, entries: list[dict] | None) -> dict[str, Any] | None:
        return None if self.top is None or entries is None else chat_logprobs(entries, self.texts, self.top)

    def message_choice(self, c: CompletionOutput) -> dict[str, Any]:
        message, finish = {"role": "assistant", "content": c.text, "refusal": None}, c.finish_reason
        if self.tools is not None:
            message, finish = tool_message(c.text, c.finish_reason, self.tools.format)
        return {
            "index": c.index,
            "message": message,
            "logprobs": self.logprobs(c.logprobs),
            "finish_reason": finish,
            "stop_reason": matched_stop(c, finish),
        }

    def response(self, out: RequestOutput) -> dict[str, Any]:
        choices = [self.message_choice(c) for c in out.outputs]
        return {**self.envelope("chat.completion", choices), "usage": usage(out)}

    def choice(
        self, delta: dict[str, Any], logprobs: dict | None = None, finish: str | None = None, index: int = 0
    ) -> dict:
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    async def chunks(self, stream: RequestStream) -> AsyncIterator[dict[str, Any]]:
        if self.tools is not None:
            async for chunk in tool_chunks(self, stream, self.tools.format):
                yield chunk
            return
        cursors = Cursors()  # one per choice (n > 1): each starts with its role, ends with its reason
        cursors[0].started = True  # the first choice's role goes out at once, before any token
        yield self.chunk(self.choice({"role": "assistant", "content": ""}))
        async for out in stream:
            for c in out.outputs:
                cursor = cursors[c.index]
                if not cursor.started:
                    cursor.started = True
                    yield self.chunk(self.choice({"role": "assistant", "content": ""}, index=c.index))
                if cursor.done:
                    continue
                delta, entries = cursor.advance(c)
                if delta or entries:
                    yield self.chunk(self.choice({"content": delta}, self.logprobs(entries), index=c.index))
                if c.finish_reason is not None:
                    cursor.done = True
                    last = self.choice({}, finish=c.finish_reason, index=c.index)
                    yield self.chunk({**last, "stop_reason": matched_stop(c, c.finish_reason)})
            if out.finished and self.include_usage:
                yield self.usage_chunk(out)


def matched_stop(c: CompletionOutput, finish: str | None) -> str | None:
    """The stop string that ended the answer (vLLM's ``stop_reason``; a stop token id is not named)."""
    return c.stop_reason if finish == "stop" and isinstance(c.stop_reason, str) else None
