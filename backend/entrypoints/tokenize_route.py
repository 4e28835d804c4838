"""``POST /tokenize``: a request's prompt token ids, as the engine would compute them (vLLM's route).

Takes the body of a chat completion (``messages``, ``tools``...) or of a completion (``prompt``) and
answers ``{"tokens", "count", "max_model_len"}`` in vLLM's shape. A gateway routing by the blocks
each backend holds (``routing = "kv"``) hashes these ids: the chat template, tool prompt and
tokenizer are the very ones the completion will use, so its hashes are the engine's.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse

from cachegw.backend.core.async_engine import AsyncEngine
from cachegw.backend.entrypoints.request_fields import EngineChatRequest, EngineCompletionRequest
from cachegw.backend.entrypoints.tool_prompt import request_tools
from cachegw.backend.entrypoints.tools import ToolRequest
from cachegw.protocol.requests import parse_request

T = TypeVar("T")


class TokenizingServer(Protocol):
    """What the route needs of the OpenAI server (``backend/entrypoints/server.py`` ``_Server``)."""

    engine: AsyncEngine
    tokenizer: Any

    async def read_body(self, request: Request) -> bytes: ...

    def check_model(self, model: str | None) -> None: ...

    def encode(self, prompt: str) -> list[int]: ...

    def chat_ids(self, req: EngineChatRequest, tools: ToolRequest | None) -> list[int]: ...

    async def in_tokenizer_thread(self, fn: Callable[..., T], *args: Any) -> T: ...


def tokenize_route(server: TokenizingServer) -> Callable[[Request], Awaitable[JSONResponse]]:
    async def tokenize(request: Request) -> JSONResponse:
        raw = await server.read_body(request)
        try:
            body = json.loads(raw)
        except ValueError:
            body = None  # parse_request below answers the 400
        ids: list[int]
        chat = isinstance(body, dict) and "messages" in body
        if chat:
            req = parse_request(EngineChatRequest, raw)
            server.check_model(req.model)
            ids = await server.in_tokenizer_thread(server.chat_ids, req, request_tools(req, server.tokenizer))
        else:
            comp = parse_request(EngineCompletionRequest, raw)
            server.check_model(comp.model)
            prompt = comp.prompt_input()
            is_text = isinstance(prompt, str)
            ids = await server.in_tokenizer_thread(server.encode, prompt) if is_text else prompt  # type: ignore[assignment]
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": server.engine.max_model_len})

    return tokenize
