"""LoRA adapters over HTTP: their model cards, and loading and unloading them at run time
(``POST /v1/load_lora_adapter`` {lora_name, lora_path}, ``POST /v1/unload_lora_adapter`` {lora_name},
the bodies vLLM takes).

Both are admin endpoints: with ``[backend_server] admin_token`` set they need it as a bearer token,
from any address; without one only clients on loopback may call them (the gateway's supervised
engine listens there). Reading an adapter's files happens in a worker thread; writing it into its
slot happens between two engine steps, so no step ever sees half an adapter.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from cachegw.backend.core.async_engine import AsyncEngine
from cachegw.backend.core.lora_ref import UnknownModel
from cachegw.backend.executor.lora_adapter import AdapterError
from cachegw.backend.executor.lora_slots import LoRASlots, SlotsFull
from cachegw.protocol.errors import ApiError
from cachegw.protocol.http import read_limited_body
from cachegw.protocol.requests import parse_request

_NAME = r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$"


class LoadAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(pattern=_NAME)
    lora_path: str = Field(min_length=1)


class UnloadAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)


def adapter_cards(slots: LoRASlots | None, base: str, created: int) -> list[dict[str, Any]]:
    """``/v1/models`` entries of the loaded adapters, each with its base model as ``parent``."""
    if slots is None:
        return []
    return [
        {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "cachegw",
            "parent": base,
            "root": base,
        }
        for name in list(slots.loaded)  # the engine thread may load one meanwhile
    ]


class AdminGuard:
    """The bearer token when one is configured, else loopback clients only."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    def check(self, request: Request) -> None:
        if self._token:
            scheme, _, value = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(), self._token):
                raise ApiError(
                    401, "Admin token required (Authorization: Bearer <token>).", code="admin_unauthorized"
                )
            return
        host = request.client.host if request.client else ""
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise ApiError(
                403,
                "Admin endpoints answer loopback clients only; set [backend_server] admin_token to call "
                "them from elsewhere.",
                code="admin_forbidden",
            )


def add_lora_routes(app: FastAPI, engine: AsyncEngine, admin_token: str, max_body: int) -> None:
    guard = AdminGuard(admin_token)

    def slots() -> LoRASlots:
        loras = engine.engine.runner.loras
        if loras is None:
            raise ApiError(400, "LoRA is off on this engine: set [engine] max_loras.", code="lora_disabled")
        return loras

    async def load(request: Request) -> JSONResponse:
        guard.check(request)
        body = parse_request(
            LoadAdapter, await read_limited_body(request, max_body), frozenset({"lora_name", "lora_path"})
        )
        loras = slots()
        if body.lora_name in loras.loaded:
            raise ApiError(400, f"The adapter `{body.lora_name}` is loaded already.", param="lora_name")
        try:
            weights = await asyncio.to_thread(loras.read, body.lora_path)

            def install(eng: Any) -> None:
                busy = {g.first.params.lora.slot for g in eng.requests.values() if g.first.params.lora}
                loras.install(body.lora_name, weights, busy)

            await engine.run_between_steps(install)
        except AdapterError as exc:
            raise ApiError(400, str(exc), param="lora_path", code="invalid_adapter") from None
        except SlotsFull as exc:
            raise ApiError(409, str(exc), code="lora_slots_full") from None
        return JSONResponse({"status": "loaded", "lora_name": body.lora_name})

    async def unload(request: Request) -> JSONResponse:
        guard.check(request)
        body = parse_request(
            UnloadAdapter, await read_limited_body(request, max_body), frozenset({"lora_name"})
        )
        loras = slots()
        try:
            await engine.run_between_steps(lambda _: loras.remove(body.lora_name))
        except UnknownModel:
            raise ApiError(
                404, f"No adapter `{body.lora_name}` is loaded.", param="lora_name", code="model_not_found"
            ) from None
        return JSONResponse({"status": "unloaded", "lora_name": body.lora_name})

    app.add_api_route("/v1/load_lora_adapter", load, methods=["POST"])
    app.add_api_route("/v1/unload_lora_adapter", unload, methods=["POST"])
