"""The Responses API: ``POST /v1/responses`` (JSON or a typed event stream), ``GET`` and ``DELETE``
``/v1/responses/{id}``.

A Response request is translated into the chat body it means (protocol/responses_request.py) and
answered by the chat pipeline, so it shares the cache with chat completions: a question asked one way
is a hit the other way, and a hit is replayed as a Response or its events. With ``store`` (the
default) the Response and the conversation before it are kept per tenant, so ``previous_response_id``
goes on from it; ``store: false`` keeps nothing of the exchange (the response cache follows
``Cache-Control`` as on every route).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import TypeAdapter

from cachegw.gateway.api.deps import PipelineDep, ResponsesDep, SettingsDep, TenantsDep
from cachegw.gateway.api.translate import translated
from cachegw.gateway.storage.responses_store import ResponsesStore
from cachegw.protocol.errors import ApiError
from cachegw.protocol.http import read_limited_body
from cachegw.protocol.requests import parse_request
from cachegw.protocol.responses_output import ResponseBuilder, ResponseStream
from cachegw.protocol.responses_request import (
    FIELDS,
    InputItem,
    ResponsesRequest,
    chat_body,
    check_supported,
)

_ITEMS: TypeAdapter[list[Any]] = TypeAdapter(list[InputItem])


def _not_found(response_id: str, param: str | None = None) -> ApiError:
    return ApiError(404, f"No response found with id '{response_id}'.", param=param, code="not_found")


async def _history(store: ResponsesStore, tenant: str, req: ResponsesRequest) -> list[dict[str, Any]]:
    """The input items before this request: the earlier conversation, then the previous output."""
    if req.previous_response_id is None:
        return []
    saved = await asyncio.to_thread(store.get, tenant, req.previous_response_id)
    if saved is None:
        raise _not_found(req.previous_response_id, "previous_response_id")
    return [*saved.items, *saved.response.get("output", [])]


def responses_router() -> APIRouter:
    router = APIRouter()

    @router.post("/v1/responses")
    async def create(
        request: Request, gw: PipelineDep, tenants: TenantsDep, store: ResponsesDep, settings: SettingsDep
    ) -> Response:
        tenant = tenants.from_headers(request.headers)
        raw = await read_limited_body(request, settings.gateway.max_request_bytes)
        req = parse_request(ResponsesRequest, raw, FIELDS)
        check_supported(req)
        history = await _history(store, tenant.id, req)
        items = [*_ITEMS.validate_python(history), *req.items()]
        answer = await gw.handle(
            request, "chat", api="responses", raw=json.dumps(chat_body(req, items)).encode()
        )
        builder = ResponseBuilder(req)
        keep = req.store is not False
        conversation = [i.model_dump(by_alias=True, exclude_none=True) for i in items]

        async def save(response: dict[str, Any] | None) -> None:
            if keep and response is not None and response.get("status") in ("completed", "incomplete"):
                await asyncio.to_thread(store.save, tenant.id, response, conversation)

        def convert(body: dict[str, Any], status: int) -> tuple[dict[str, Any], int]:
            return (builder.from_chat(body), 200) if status == 200 else (body, status)

        stream = ResponseStream(builder)
        out = translated(answer, convert, lambda: stream, lambda: save(stream.final))
        if isinstance(out, JSONResponse) and out.status_code == 200:
            await save(json.loads(bytes(out.body)))
        return out

    @router.get("/v1/responses/{response_id}")
    async def get(
        response_id: str, request: Request, tenants: TenantsDep, store: ResponsesDep
    ) -> dict[str, Any]:
        tenant = tenants.from_headers(request.headers)
        saved = await asyncio.to_thread(store.get, tenant.id, response_id)
        if saved is None:
            raise _not_found(response_id)
        return saved.response

    @router.delete("/v1/responses/{response_id}")
    async def delete(
        response_id: str, request: Request, tenants: TenantsDep, store: ResponsesDep
    ) -> dict[str, Any]:
        tenant = tenants.from_headers(request.headers)
        if not await asyncio.to_thread(store.delete, tenant.id, response_id):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    return router
