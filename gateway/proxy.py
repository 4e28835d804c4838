"""Talking to backends: one shared httpx client for the built-in engine, vLLM, SGLang or llama.cpp.

Streams pass through chunk by chunk with no added buffering; on the way an ``SseRecorder``
reads the same bytes to rebuild the complete answer for the cache and the request log.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import httpx

from policies.routing import Router, RoutingMode
from protocol.errors import ApiError

log = logging.getLogger("cachegw.gateway")


def backend_unavailable(url: str, exc: Exception) -> ApiError:
    if isinstance(exc, httpx.TimeoutException):
        return ApiError(
            504,
            f"The backend at {url} did not answer in time ({type(exc).__name__}).",
            type="backend_error",
            code="backend_timeout",
        )
    return ApiError(
        502,
        f"The backend at {url} is unavailable ({type(exc).__name__}: {exc}).",
        type="backend_error",
        code="backend_unavailable",
    )


# A backend that refused a connection is tried last for this long; a request it would have answered goes
# to its next choice meanwhile (only refused connections are retried: the request never reached it).
DOWN_FOR_S = 5.0
_RETRYABLE = (httpx.ConnectError, httpx.ConnectTimeout)


class Backends:
    """The configured backends: which serve a model, in which order to try them, and the one HTTP client."""

    def __init__(
        self, urls: list[str], connect_timeout: float, read_timeout: float, routing: RoutingMode = "prefix"
    ) -> None:
        self.urls = [u.rstrip("/") for u in urls]
        timeout = httpx.Timeout(read_timeout, connect=connect_timeout)
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
        self.client = httpx.AsyncClient(timeout=timeout, limits=limits)
        self.router = Router(routing)
        self._models: dict[str, list[str]] = {}  # model id -> the backends serving it, in configured order
        self._down_until: dict[str, float] = {}
        self.answered: Counter[str] = Counter()  # per backend, read by the Prometheus collector
        self.refused: Counter[str] = Counter()
        self.no_salt: set[str] = set()  # backends that answered a 400 naming cache_salt

    async def close(self) -> None:
        await self.client.aclose()

    async def list_models(self) -> list[dict[str, Any]]:
        """The union of the backends' /v1/models, one card per model (a down backend contributes nothing)."""
        cards: dict[str, dict[str, Any]] = {}
        for url in self.urls:
            try:
                r = await self.client.get(f"{url}/models", timeout=5.0)
                r.raise_for_status()
                for card in r.json().get("data", []):
                    serving = self._models.setdefault(card["id"], [])
                    if url not in serving:
                        serving.append(url)
                        serving.sort(key=self.urls.index)
                    cards.setdefault(card["id"], card)
            except (httpx.HTTPError, ValueError, KeyError):
                continue
        return list(cards.values())

    async def route(self, model: str | None) -> list[str]:
        """The backends that may answer ``model`` (404 for a model none of them serves)."""
        if model and model not in self._models:
            await self.list_models()
        if model and model in self._models:
            return list(self._models[model])
        if model and self._models:
            raise ApiError(
                404,
                f"The model '{model}' does not exist or you do not have access to it.",
                param="model",
                code="model_not_found",
            )
        return list(self.urls)

    def refusing(self) -> list[str]:
        """Backends that refused a connection within the last DOWN_FOR_S (tried last meanwhile)."""
        now = time.monotonic()
        return [u for u in self.urls if self._down_until.get(u, 0.0) > now]

    def unreachable_models(self) -> list[str]:
        """Models every one of whose backends refused a connection lately (all backends, before any
        model is known)."""
        down = set(self.refusing())
        if not self._models:
            return ["*"] if down and down >= set(self.urls) else []
        return sorted(m for m, urls in self._models.items() if urls and set(urls) <= down)

    def order(self, urls: list[str], endpoint: str, body: dict[str, Any]) -> list[str]:
        """The routing policy's order, with backends that refused a connection lately moved last."""
        refusing = set(self.refusing())
        return sorted(self.router.order(urls, endpoint, body), key=lambda u: u in refusing)  # stable sort

    async def _send(
        self, urls: list[str], path: str, body: dict[str, Any], cache_salt: str | None = None
    ) -> tuple[str, httpx.Response]:
        """POST to the first backend that takes the connection; (its url, the response, body unread).

        ``cache_salt`` replaces the body's own for backends that take it; one that answers a 400
        naming ``cache_salt`` is remembered and sent the client's body as it came from then on."""
        last: Exception | None = None
        for url in urls:
            salted = cache_salt is not None and url not in self.no_salt
            try:
                response = await self._post(url, path, {**body, "cache_salt": cache_salt} if salted else body)
                if salted and response.status_code == 400 and b"cache_salt" in await response.aread():
                    await response.aclose()
                    self.no_salt.add(url)
                    log.warning("backend %s refuses cache_salt: tenants share its prefix cache", url)
                    response = await self._post(url, path, body)
            except _RETRYABLE as exc:
                self._down_until[url] = time.monotonic() + DOWN_FOR_S
                self.refused[url] += 1
                log.warning("backend %s refused the connection (%s); next one", url, type(exc).__name__)
                last = exc
                continue
            except httpx.HTTPError as exc:
                raise backend_unavailable(url, exc) from exc
            self._down_until.pop(url, None)
            self.answered[url] += 1
            return url, response
        assert last is not None, "no backend to send to"
        raise backend_unavailable(", ".join(urls), last) from last

    async def _post(self, url: str, path: str, body: dict[str, Any]) -> httpx.Response:
        request = self.client.build_request("POST", f"{url}{path}", json=body)
        return await self.client.send(request, stream=True)

    async def post_json(
        self, urls: list[str], path: str, body: dict[str, Any], cache_salt: str | None = None
    ) -> tuple[int, dict[str, Any], float, str]:
        """(status, JSON body, ms, the backend that answered)."""
        start = time.perf_counter()
        url, r = await self._send(urls, path, body, cache_salt)
        try:
            await r.aread()
        except httpx.HTTPError as exc:
            raise backend_unavailable(url, exc) from exc
        finally:
            await r.aclose()
        try:
            data = r.json()
        except ValueError as exc:
            raise ApiError(
                502,
                f"The backend at {url} sent a response that is not JSON.",
                type="backend_error",
                code="backend_bad_response",
            ) from exc
        return r.status_code, data, (time.perf_counter() - start) * 1e3, url

    async def open_stream(
        self, urls: list[str], path: str, body: dict[str, Any], cache_salt: str | None = None
    ) -> tuple[str, httpx.Response]:
        """Send the request and return the backend that took it and its response, body not yet read."""
        return await self._send(urls, path, body, cache_salt)


class SseRecorder:
    """Rebuilds a non-stream response from the SSE bytes of a chat or completion stream."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.text: list[str] = []
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.meta: dict[str, Any] = {}
        self.done = False
        self.error = False
        self.calls: dict[int, dict[str, Any]] = {}  # tool calls by index, reassembled from their deltas
        self.extra: dict[str, list[Any]] = {}  # other delta fields (refusal, reasoning_content, ...)
        self.relayed_bytes = 0  # passed on to the client so far
        self.broken: str | None = None  # why the backend's stream ended before [DONE], if it did

    def feed_event(self, event: bytes) -> bool:
        """Read one SSE event; True if it is the usage-only chunk (no choices)."""
        usage_only = False
        for line in event.split(b"\n"):
            if line.startswith(b"data:"):
                usage_only |= self._data(line[5:].strip())
        return usage_only

    def _data(self, data: bytes) -> bool:
        if data == b"[DONE]":
            self.done = True
            return False
        try:
            obj = json.loads(data)
        except ValueError:
            self.error = True
            return False
        if "error" in obj:
            self.error = True
            return False
        if obj.get("usage"):
            self.usage = obj["usage"]
        for key in ("id", "model", "created", "system_fingerprint"):
            self.meta.setdefault(key, obj.get(key))
        for choice in obj.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            if self.endpoint == "chat":
                delta = choice.get("delta") or {}
                if not self._tool_call_deltas(delta.get("tool_calls")):
                    self.error = True  # pieces that cannot be put together: never stored
                if delta.get("content"):
                    self.text.append(delta["content"])
                for key, value in delta.items():
                    if key not in ("role", "content", "tool_calls") and value not in (None, "", []):
                        self.extra.setdefault(key, []).append(value)
            elif choice.get("text"):
                self.text.append(choice["text"])
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return obj.get("choices") == [] and bool(obj.get("usage"))

    def _tool_call_deltas(self, deltas: Any) -> bool:
        """Fold one chunk's tool-call deltas into ``calls`` as the openai SDK does: by ``index``, the
        name and arguments concatenated from their pieces, ``id`` and ``type`` from the chunk that
        carries them. False for pieces that are not shaped like a tool-call delta."""
        if deltas in (None, []):
            return True
        if not isinstance(deltas, list):
            return False
        for d in deltas:
            index = d.get("index") if isinstance(d, dict) else None
            if not isinstance(index, int) or isinstance(index, bool):
                return False
            call = self.calls.setdefault(index, {"id": "", "type": "function", "function": {}})
            if d.get("id"):
                call["id"] = d["id"]
            if d.get("type"):
                call["type"] = d["type"]
            fn = d.get("function") or {}
            if not isinstance(fn, dict):
                return False
            for key in ("name", "arguments"):
                piece = fn.get(key)
                if piece is not None and not isinstance(piece, str):
                    return False
                call["function"][key] = call["function"].get(key, "") + (piece or "")
        return True

    def complete_response(self) -> dict[str, Any] | None:
        """The answer as one non-stream response, or None unless the stream ended well."""
        if not self.done or self.error or self.finish_reason is None:
            return None
        text = "".join(self.text)
        if self.endpoint == "chat":
            extra = {
                k: "".join(v) if all(isinstance(x, str) for x in v) else v for k, v in self.extra.items()
            }
            if self.calls:  # as OpenAI's JSON has them: content null when the answer is only calls
                extra["tool_calls"] = [self.calls[i] for i in sorted(self.calls)]
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text or (None if self.calls else ""), **extra},
                "finish_reason": self.finish_reason,
            }
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "finish_reason": self.finish_reason, "logprobs": None}
            obj = "text_completion"
        return {
            "id": self.meta.get("id"),
            "object": obj,
            "created": self.meta.get("created"),
            "model": self.meta.get("model"),
            "choices": [choice],
            "usage": self.usage,
        }


async def relay(
    response: httpx.Response, recorder: SseRecorder, drop_usage_chunk: bool
) -> AsyncIterator[bytes]:
    """The backend's SSE events as they arrive, each passed on whole. When the gateway asked for a
    usage chunk that the client did not (to record tokens), that one event is held back.

    A stream the backend breaks (connection lost, or closed before ``[DONE]``) ends with one
    OpenAI-style error event instead of a dropped connection, so clients can tell a fault from an
    answer; ``recorder.broken`` says why, and such an answer is never stored."""
    buffer = b""
    try:
        try:
            async for chunk in response.aiter_raw():
                buffer += chunk
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    if recorder.feed_event(event) and drop_usage_chunk:
                        continue
                    recorder.relayed_bytes += len(event) + 2
                    yield event + b"\n\n"
        except httpx.HTTPError as exc:  # the backend died or the connection broke mid-stream
            recorder.broken = f"{type(exc).__name__}: {exc}"[:200] or type(exc).__name__
        if buffer.strip() and recorder.broken is None:
            recorder.feed_event(buffer)
            recorder.relayed_bytes += len(buffer)
            yield buffer
        elif buffer.strip():
            recorder.error = True  # a torn last event: never part of a stored answer
        if recorder.broken is None and not recorder.done and not recorder.error:
            recorder.broken = "the backend closed the stream before [DONE]"
        if recorder.broken is not None:
            recorder.error = True
            yield stream_error_event(f"The backend's stream broke: {recorder.broken}")
    finally:
        await response.aclose()


def stream_error_event(message: str, code: str = "backend_error") -> bytes:
    """One SSE event carrying an OpenAI-style error body (what OpenAI sends for a failed stream)."""
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return b"data: " + json.dumps(body).encode() + b"\n\n"
