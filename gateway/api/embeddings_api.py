"""``POST /v1/embeddings``: OpenAI's embeddings API, an exact cache entry per input
(``gateway/request/embeddings.py``)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from cachegw.gateway.api.deps import EmbeddingsDep


def embeddings_router() -> APIRouter:
    router = APIRouter()

    @router.post("/v1/embeddings")
    async def embeddings(request: Request, flow: EmbeddingsDep) -> Response:
        return await flow.handle(request)

    return router
