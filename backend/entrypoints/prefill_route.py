"""The prefill side of disaggregation: ``POST /v1/prefill`` and what a ``role = "prefill"`` engine refuses.

A decode engine (``prefill_peer.py``) sends a prompt's token ids, its cache salt and the adapter's name;
this engine computes the prompt (one greedy token, thrown away: the last prompt token's logits are the
only ones the engine cannot skip), writes the prompt's reusable blocks to its disk/Redis stores and only
then answers ``{"prompt_tokens", "cached_tokens", "handed_over_tokens"}``: the decode engine reads the
blocks as soon as the answer arrives, so they must already be there (write-behind would race).

A prefill engine answers no completions: a client or gateway sent to it by mistake gets a 400 saying
where to go, rather than answers computed on the engine meant to keep long prompts off the decoders.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from cachegw.backend.core.async_engine import AsyncEngine, RequestStream
from cachegw.backend.core.engine import LLMEngine
from cachegw.backend.core.kv_handover import reusable_hashes, store_copies, take_copies
from cachegw.backend.core.lora_ref import LoRARef
from cachegw.backend.core.outputs import RequestOutput
from cachegw.backend.core.sampling_params import SamplingParams
from cachegw.protocol.errors import ApiError
from cachegw.protocol.requests import parse_request

PREFILL_PATH = "/v1/prefill"
_FIELDS = frozenset({"prompt", "model", "cache_salt"})


class PrefillRequest(BaseModel):
    """A prompt to compute for a decode engine: token ids as the decode engine tokenized them."""

    model_config = ConfigDict(extra="forbid")

    prompt: list[int] = Field(min_length=1)
    model: str | None = None
    cache_salt: str | None = None


class PrefillServer(Protocol):
    """What the route needs of the OpenAI server (``backend/entrypoints/server.py`` ``_Server``)."""

    engine: AsyncEngine

    async def read_body(self, request: Request) -> bytes: ...

    def generation_model(self, model: str | None) -> LoRARef | None: ...

    async def start(
        self, request_id: str, prompt: list[int], params: SamplingParams, salt: str | None
    ) -> RequestStream: ...

    async def final_output(self, request: Request, stream: RequestStream) -> RequestOutput: ...


def prefill_route(
    server: PrefillServer, id_of: Callable[[Request], str]
) -> Callable[[Request], Awaitable[JSONResponse]]:
    """``POST /v1/prefill`` over ``server`` (an engine with a disk or Redis store)."""

    async def prefill(request: Request) -> JSONResponse:
        req = parse_request(PrefillRequest, await server.read_body(request), _FIELDS)
        lora = server.generation_model(req.model)
        params = SamplingParams(max_tokens=1, temperature=0.0)
        params.lora = lora
        stream = await server.start(id_of(request), req.prompt, params, req.cache_salt)
        out = await server.final_output(request, stream)
        engine = server.engine.engine
        tier = engine.kv_tier
        assert tier is not None, "the route is only added to engines with a store"
        adapter = lora.digest if lora is not None else None
        hashes = reusable_hashes(req.prompt, engine.config.block_size, req.cache_salt, adapter)

        def copies(e: LLMEngine) -> list:
            return take_copies(e.block_manager, e.runner, tier, hashes)

        taken = await server.engine.run_between_steps(copies)
        await asyncio.to_thread(tier.flush)  # blocks written behind are done: not written twice
        handed = await asyncio.to_thread(store_copies, tier, taken)
        return JSONResponse(
            {
                "prompt_tokens": len(req.prompt),
                "cached_tokens": out.num_cached_tokens,
                "handed_over_tokens": handed * engine.config.block_size,
            }
        )

    return prefill


async def prefill_only(request: Request) -> Response:
    """What a ``role = "prefill"`` engine answers to a completion or chat completion."""
    raise ApiError(
        400,
        'This engine runs with role = "prefill": it computes prompts\' KV for decode engines '
        f"(POST {PREFILL_PATH}) and answers no completions. Send completions to a decode engine "
        '(role = "decode", or "both").',
        code="prefill_only",
    )
