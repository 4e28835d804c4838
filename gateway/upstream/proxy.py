"""Talking to backends: one shared httpx client for the built-in engine, vLLM, SGLang or llama.cpp.

Which backends serve a model, in which order to try them, with which credentials; a backend the
health probes marked down is skipped, and requests waiting on it give up. Streams are relayed by
``gateway.upstream.streams``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import httpx

from cachegw.gateway.config import BackendSpec
from cachegw.gateway.upstream.kv_router import KvRouter
from cachegw.gateway.upstream.streams import MarkedDown, unless_gone
from cachegw.policies.kv_routing import KvChoice
from cachegw.policies.routing import Router, RoutingMode
from cachegw.protocol.errors import ApiError

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
RELIST_AFTER_S = 5.0  # an unknown model re-reads the backends' model lists at most this often
_RETRYABLE = (httpx.ConnectError, httpx.ConnectTimeout)
KEEPALIVE_S = 4.0  # below the 5 s idle timeout of uvicorn-served backends


class Backends:
    """The configured backends: which serve a model, in which order to try them, and the one HTTP client.

    Each backend's own headers (its API key) go on every request to it; nothing of the client's request
    but the body is forwarded, so a client's key never reaches a backend. The gateway adds its own
    ``headers`` to a request (the request id and trace context, ``gateway/request/tracing.py``); a
    backend's configured headers win over them."""

    def __init__(
        self,
        backends: Sequence[BackendSpec | str],
        connect_timeout: float,
        read_timeout: float,
        routing: RoutingMode = "prefix",
        retry_after_s: int = 5,
        clock: Callable[[], float] = time.monotonic,
        kv_load_penalty: float = 64.0,
        kv_metrics_interval_s: float = 0.5,
        kv_tier_weight: float = 0.8,
    ) -> None:
        self._clock = clock
        self._listed_at = -RELIST_AFTER_S  # when the model lists were last read (clock time)
        specs = [b if isinstance(b, BackendSpec) else BackendSpec(url=b) for b in backends]
        self.urls = [s.url for s in specs]
        self._headers = {s.url: s.upstream_headers() for s in specs}
        self.takes_drafts = {s.url for s in specs if s.drafts}
        self.takes_pins = {s.url for s in specs if s.pins}
        timeout = httpx.Timeout(read_timeout, connect=connect_timeout)
        # An idle connection is dropped after KEEPALIVE_S, before the server's own idle timeout (5 s in
        # uvicorn, so in vLLM, SGLang and our engine) closes it: with equal timeouts, a request sent on
        # a connection the server was closing at that moment failed with a ReadError (502).
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=64, keepalive_expiry=KEEPALIVE_S)
        self.client = httpx.AsyncClient(timeout=timeout, limits=limits)
        self.router = Router(routing)
        self.kv: KvRouter | None = None  # routing = "kv": started by the composition root
        if routing == "kv":
            self.kv = KvRouter(
                self.client, self.headers, specs, kv_load_penalty, kv_metrics_interval_s, kv_tier_weight
            )
        self._models: dict[str, list[str]] = {}  # model id -> the backends serving it, in configured order
        self._down_until: dict[str, float] = {}
        self.answered: Counter[str] = Counter()  # per backend, read by the Prometheus collector
        self.refused: Counter[str] = Counter()
        self.no_salt: set[str] = set()  # backends that answered a 400 naming cache_salt
        self.down: set[str] = set()  # marked down by the health probes (gateway/upstream/health.py): skipped
        self._gone: dict[str, asyncio.Event] = {}  # set (and replaced) when a backend is marked down
        self.retry_after_s = retry_after_s  # told to clients when no backend of a model is up

    def headers(self, url: str) -> dict[str, str]:
        """The backend's own headers (its credentials); copied, so a caller cannot change them."""
        return dict(self._headers[url])

    def mark(self, url: str, up: bool) -> None:
        """The health probes' verdict; an answered probe also ends a refused connection's pause."""
        if up:
            self.down.discard(url)
            self._down_until.pop(url, None)
        else:
            self.down.add(url)
            if url in self._gone:
                self._gone.pop(url).set()  # requests waiting on it give up; later ones get a new event

    def gone(self, url: str) -> asyncio.Event:
        """Set when the probes mark ``url`` down from now on (requests under way wait on it too)."""
        return self._gone.setdefault(url, asyncio.Event())

    def unavailable(self) -> ApiError:
        """The 503 of a miss no backend that is up can answer; clients may retry after a probe round."""
        return ApiError(
            503,
            "No backend serving this model is answering its health checks; retry after "
            f"{self.retry_after_s} s (cached answers are still served).",
            type="backend_error",
            code="backend_unavailable",
            headers={"Retry-After": str(self.retry_after_s)},
        )

    async def close(self) -> None:
        if self.kv is not None:
            await self.kv.close()
        await self.client.aclose()

    async def list_models(self) -> list[dict[str, Any]]:
        """The union of the backends' /v1/models, one card per model (a down backend contributes nothing)."""
        cards: dict[str, dict[str, Any]] = {}
        self._listed_at = self._clock()
        for url in self.urls:
            if url in self.down:  # a hung backend would hold every caller for the timeout
                continue
            try:
                r = await self.client.get(f"{url}/models", headers=self._headers[url], timeout=5.0)
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
        """The backends that may answer ``model`` (404 for a model none of them serves).

        An unknown name re-reads the backends' lists (a model loaded since), but at most every
        RELIST_AFTER_S: requests naming models nobody serves must not each cost a listing per backend."""
        if model and model not in self._models and self._clock() - self._listed_at >= RELIST_AFTER_S:
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
        """Models every one of whose backends is marked down or refused a connection lately (all
        backends, before any model is known)."""
        down = set(self.refusing()) | self.down
        if not self._models:
            return ["*"] if down and down >= set(self.urls) else []
        return sorted(m for m, urls in self._models.items() if urls and set(urls) <= down)

    def order(self, urls: list[str], endpoint: str, body: dict[str, Any]) -> list[str]:
        """The routing policy's order over the backends that are up, those that refused a connection
        lately moved last; a 503 with ``Retry-After`` at once when the probes marked all of them down."""
        up = [u for u in urls if u not in self.down]
        if not up:
            raise self.unavailable()
        return self._refusing_last(self.router.order(up, endpoint, body))

    def _refusing_last(self, urls: list[str]) -> list[str]:
        refusing = set(self.refusing())
        return sorted(urls, key=lambda u: u in refusing)  # stable sort

    async def kv_order(
        self, urls: list[str], endpoint: str, body: dict[str, Any], salt: str | None
    ) -> tuple[list[str], KvChoice | None]:
        """With ``routing = "kv"`` and a choice to make: ``order``'s backends ranked by the prefix each
        holds net of its load (``gateway/upstream/kv_router.py``), and why the first won."""
        if self.kv is None or len(urls) < 2:
            return urls, None
        choice = await self.kv.order(urls, endpoint, body, salt)
        return self._refusing_last(choice.order), choice

    def _for_backend(self, url: str, body: dict[str, Any], draft: str | None) -> dict[str, Any]:
        """The body with ``cachegw_draft`` for a backend that takes drafts (the gateway's draft over
        the client's own); without it for any other, which may not know the field. ``cache_pins``
        (gateway/api/messages_api.py) likewise goes only to backends that pin."""
        if "cache_pins" in body and url not in self.takes_pins:  # a backend that cannot pin: no pins
            body = {k: v for k, v in body.items() if k != "cache_pins"}
        if url in self.takes_drafts:
            return {**body, "cachegw_draft": draft} if draft else body
        return {k: v for k, v in body.items() if k != "cachegw_draft"} if "cachegw_draft" in body else body

    async def _send(
        self,
        urls: list[str],
        path: str,
        body: dict[str, Any],
        cache_salt: str | None = None,
        draft: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> tuple[str, httpx.Response]:
        """POST to the first backend that takes the connection; (its url, the response, body unread).

        ``cache_salt`` replaces the body's own for backends that take it; one that answers a 400
        naming ``cache_salt`` is remembered and sent the client's body as it came from then on.
        ``draft`` goes to the backends that take drafts (``_for_backend``)."""
        last: Exception | None = None
        original = body
        for url in urls:
            body = self._for_backend(url, original, draft)
            salted = cache_salt is not None and url not in self.no_salt
            gone = self.gone(url)
            try:
                salted_body = {**body, "cache_salt": cache_salt} if salted else body
                response = await unless_gone(gone, self._post(url, path, salted_body, headers))
                if salted and response.status_code == 400 and b"cache_salt" in await response.aread():
                    await response.aclose()
                    self.no_salt.add(url)
                    log.warning("backend %s refuses cache_salt: tenants share its prefix cache", url)
                    response = await unless_gone(gone, self._post(url, path, body, headers))
            except MarkedDown:
                raise self.unavailable() from None
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

    async def _post(
        self, url: str, path: str, body: dict[str, Any], headers: Mapping[str, str] | None = None
    ) -> httpx.Response:
        sent = {**headers, **self._headers[url]} if headers else self._headers[url]
        request = self.client.build_request("POST", f"{url}{path}", json=body, headers=sent)
        return await self.client.send(request, stream=True)

    async def post_json(
        self,
        urls: list[str],
        path: str,
        body: dict[str, Any],
        cache_salt: str | None = None,
        draft: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> tuple[int, dict[str, Any], float, str]:
        """(status, JSON body, ms, the backend that answered)."""
        start = time.perf_counter()
        url, r = await self._send(urls, path, body, cache_salt, draft, headers)
        try:
            await unless_gone(self.gone(url), r.aread())
        except MarkedDown:
            raise self.unavailable() from None
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
        self,
        urls: list[str],
        path: str,
        body: dict[str, Any],
        cache_salt: str | None = None,
        draft: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> tuple[str, httpx.Response]:
        """Send the request and return the backend that took it and its response, body not yet read."""
        return await self._send(urls, path, body, cache_salt, draft, headers)
