"""``POST /v1/embeddings`` on the engine's OpenAI server.

Each input (text, or token ids) is embedded by ``backend/executor/embedding_forward.py``: the model's
final hidden states, mean-pooled over the input's tokens and L2-normalized, so a dot product is the
cosine similarity. The forward runs in the engine's loop thread between two steps, in batches of at
most ``[engine] max_num_batched_tokens`` tokens, so generation goes on between batches.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol, TypeVar

import torch
from fastapi import Request
from fastapi.responses import JSONResponse
from prometheus_client import Counter

from cachegw.backend.core.async_engine import AsyncEngine, EngineDeadError
from cachegw.backend.core.engine import LLMEngine
from cachegw.backend.entrypoints.metrics import ServerMetrics
from cachegw.backend.executor.embedding_forward import MeanPooledEmbedder, batches
from cachegw.protocol.embedding_request import EmbeddingInput, parse_embedding_request
from cachegw.protocol.errors import ApiError

T = TypeVar("T")


class EmbeddingServer(Protocol):
    """What the endpoint needs of the OpenAI server (``backend/entrypoints/server.py`` ``_Server``)."""

    engine: AsyncEngine
    model_name: str
    tokenizer: Any
    metrics: ServerMetrics  # the endpoint's counters join its registry

    async def read_body(self, request: Request) -> bytes: ...

    def check_model(self, model: str | None) -> None: ...

    async def in_tokenizer_thread(self, fn: Callable[..., T], *args: Any) -> T: ...


def float32_base64(vector: torch.Tensor) -> str:
    """OpenAI's ``encoding_format: "base64"``: the little-endian float32 bytes, base64-encoded."""
    return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode("ascii")


class EmbeddingsEndpoint:
    def __init__(self, server: EmbeddingServer) -> None:
        registry = server.metrics.registry
        self.server = server
        self.spec = server.engine.engine.runner.spec
        self.budget = server.engine.engine.config.max_num_batched_tokens
        self._embedder: MeanPooledEmbedder | None = None  # built in the engine thread on first use
        self.inputs = Counter(
            "cachegw:embedding_inputs", "Inputs embedded by /v1/embeddings.", registry=registry
        )
        self.tokens = Counter(
            "cachegw:embedding_tokens", "Tokens embedded by /v1/embeddings.", registry=registry
        )

    def _token_lists(self, inputs: list[EmbeddingInput]) -> list[list[int]]:
        """Every input as token ids (the tokenizer thread's work)."""
        tokenizer = self.server.tokenizer
        if tokenizer is None and any(isinstance(item, str) for item in inputs):
            raise ApiError(400, "This model has no tokenizer: send the input as token ids.", param="input")
        return [
            tokenizer.encode(item, add_special_tokens=False) if isinstance(item, str) else item
            for item in inputs
        ]

    def _check(self, ids: list[list[int]]) -> None:
        limit, vocab = self.server.engine.max_model_len, self.spec.vocab_size
        for i, seq in enumerate(ids):
            where = "input" if len(ids) == 1 else f"input[{i}]"
            if not seq:
                raise ApiError(400, f"Invalid value for 'input': {where} has no tokens.", param="input")
            if len(seq) > limit:
                raise ApiError(
                    400,
                    f"This model's maximum context length is {limit} tokens, however {where} has "
                    f"{len(seq)} tokens. Please reduce the length of the input.",
                    param="input", code="context_length_exceeded",
                )  # fmt: skip
            if max(seq) >= vocab:
                raise ApiError(
                    400, f"Invalid value for 'input': {where} holds a token id beyond the vocabulary "
                    f"({vocab} tokens).", param="input",
                )  # fmt: skip

    def _embed_in_engine(self, engine: LLMEngine, ids: list[list[int]]) -> torch.Tensor:
        if self._embedder is None:
            self._embedder = MeanPooledEmbedder(engine.runner)
        return self._embedder.embed(ids)

    async def embed(self, ids: list[list[int]]) -> torch.Tensor:
        """[len(ids), hidden] unit vectors, one engine-thread call per batch of the token budget."""
        parts = []
        for group in batches([len(seq) for seq in ids], self.budget):
            work = partial(self._embed_in_engine, ids=[ids[i] for i in group])
            try:
                parts.append(await self.server.engine.run_between_steps(work))
            except EngineDeadError as exc:
                raise ApiError(503, str(exc), type="server_error", code="engine_unavailable") from None
        return torch.cat(parts)

    async def create(self, request: Request) -> JSONResponse:
        req = parse_embedding_request(await self.server.read_body(request))
        self.server.check_model(req.model)
        hidden = self.spec.hidden_size
        if req.dimensions is not None and req.dimensions != hidden:
            raise ApiError(
                400, f"This model's embeddings have {hidden} dimensions; 'dimensions' must be {hidden} or "
                "left out (they are not truncated).", param="dimensions",
            )  # fmt: skip
        inputs = req.inputs()
        ids = await self.server.in_tokenizer_thread(self._token_lists, inputs)
        self._check(ids)
        vectors = await self.embed(ids)
        tokens = sum(len(seq) for seq in ids)
        self.inputs.inc(len(ids))
        self.tokens.inc(tokens)
        data = [
            {
                "object": "embedding",
                "index": i,
                "embedding": float32_base64(v) if req.base64 else v.tolist(),
            }
            for i, v in enumerate(vectors)
        ]
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        return JSONResponse({"object": "list", "data": data, "model": self.server.model_name, "usage": usage})
