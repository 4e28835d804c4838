"""The OpenAI-compatible HTTP server in front of the engine (`cachegw backend`).

Every answer that is not a success is OpenAI's error JSON with a 4xx/5xx status: bad input is
rejected before a stream starts (the engine validates on add), and an engine failure fails only
the requests it hit. A client that goes away, streaming or not, aborts its request so its KV
blocks are freed at once.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import re
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from cachegw.backend.config import EngineConfig, load_backend_server_config
from cachegw.backend.core.async_engine import AsyncEngine, EngineDeadError, EngineError, RequestStream
from cachegw.backend.core.lora_ref import LoRARef
from cachegw.backend.core.outputs import RequestOutput
from cachegw.backend.core.sampling_params import InvalidParameter, SamplingParams
from cachegw.backend.entrypoints.chat_shaper import ChatShaper
from cachegw.backend.entrypoints.choices import CompletionShaper, Echo
from cachegw.backend.entrypoints.embeddings import EmbeddingsEndpoint
from cachegw.backend.entrypoints.health_routes import add_health_routes
from cachegw.backend.entrypoints.lora_routes import adapter_cards, add_lora_routes
from cachegw.backend.entrypoints.metrics import ServerMetrics
from cachegw.backend.entrypoints.openai_mapping import (
    TokenTexts,
    invalid_parameter,
    sampling_params,
)
from cachegw.backend.entrypoints.pin_fields import pin_requests, requested_pins
from cachegw.backend.entrypoints.prefill_peer import PrefillPeer
from cachegw.backend.entrypoints.prefill_route import PREFILL_PATH, prefill_only, prefill_route
from cachegw.backend.entrypoints.request_fields import (
    EngineChatRequest,
    EngineCompletionRequest,
    check_fields,
)
from cachegw.backend.entrypoints.tokenize_route import tokenize_route
from cachegw.backend.entrypoints.tool_prompt import answer_constraint, chat_prompt_ids, request_tools
from cachegw.backend.entrypoints.tools import ToolRequest
from cachegw.backend.executor.cpu_threads import ThreadPlan
from cachegw.backend.executor.model_loader import EMBEDDED_GGUF
from cachegw.protocol import sse
from cachegw.protocol.errors import ApiError, error_body
from cachegw.protocol.http import ClientGone, install_error_handlers, read_limited_body
from cachegw.protocol.requests import ChatCompletionRequest, CompletionRequest, parse_request

log = logging.getLogger("cachegw.backend")

DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is still there
T = TypeVar("T")
_GIVEN_ID = re.compile(r"[A-Za-z0-9._:-]{1,96}")  # an x-request-id the completion id may carry


def completion_id(prefix: str, request: Request) -> str:
    """The answer's id: with the caller's ``x-request-id`` in it (as vLLM does), so a gateway's request
    log and this server's logs name one request alike; a random tail keeps ids unique. The caller's
    ``traceparent`` is logged beside it (debug)."""
    given = request.headers.get("x-request-id", "")
    tail = uuid.uuid4().hex
    rid = f"{prefix}-{given}-{tail[:12]}" if _GIVEN_ID.fullmatch(given) else f"{prefix}-{tail}"
    log.debug("%s: traceparent %s", rid, request.headers.get("traceparent", "-"))
    return rid


class _EventStream(StreamingResponse):
    """SSE response that closes the request's stream however the response ends.

    Starlette cancels the body on disconnect but never closes the generator, so the abort must
    not depend on garbage collection.
    """

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _own_tokenizer(engine: AsyncEngine) -> Any:
    """A tokenizer the engine thread never touches: a copy, else a fresh load of the same files."""
    shared = engine.engine.tokenizer
    if shared is None:
        return None
    if hasattr(shared, "fork"):  # ours: the Rust tokenizer shared, never changed (core/tokenizer.py)
        return shared.fork()
    try:
        return copy.deepcopy(shared)
    except Exception:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(engine.engine.model_dir))


async def _last_output(stream: RequestStream) -> RequestOutput:
    last: RequestOutput | None = None
    async for out in stream:
        last = out
    if last is None:
        raise EngineError("the request ended without output")
    return last


class _Server:
    """Endpoint handlers and the state they share."""

    def __init__(self, engine: AsyncEngine, model_name: str, max_request_bytes: int) -> None:
        self.engine = engine
        self.model_name = model_name
        self.max_request_bytes = max_request_bytes
        self.created = int(time.time())
        # The engine thread owns the engine's tokenizer (fast tokenizers are not safe to share
        # across threads), so the HTTP side works on its own copy, in one worker thread so that
        # long prompts never block the event loop.
        self.tokenizer = _own_tokenizer(engine)
        self.tokenizer_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cachegw-tokenizer")
        self.texts = TokenTexts(self.tokenizer)
        self.metrics = ServerMetrics(engine.stats)
        engine.add_finish_listener(self.metrics.observe_finished)
        decode = engine.engine.config.role == "decode"  # its long prompts computed by its prefill engine
        self.peer = PrefillPeer(engine, self.metrics.registry) if decode else None

    # --- request plumbing ----------------------------------------------------------------------

    async def read_body(self, request: Request) -> bytes:
        return await read_limited_body(request, self.max_request_bytes)

    def check_model(self, model: str | None) -> None:
        """The base model (embeddings): an adapter's name is a 400, any other a 404."""
        if self.generation_model(model) is not None:
            raise ApiError(
                400, f"`{model}` is a LoRA adapter; embeddings come from `{self.model_name}`.", param="model"
            )

    def generation_model(self, model: str | None) -> LoRARef | None:
        """The adapter a completion runs under (None: the base); 404 for a model not served."""
        loras = self.engine.engine.runner.loras
        ref = loras.ref(model) if loras is not None and model is not None else None
        if ref is None and model is not None and model != self.model_name:
            raise ApiError(
                404, f"The model `{model}` does not exist. This server serves `{self.model_name}`.",
                param="model", code="model_not_found",
            )  # fmt: skip
        return ref

    async def in_tokenizer_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_pool, fn, *args)

    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ApiError(400, "This model has no tokenizer: send the prompt as token ids.", param="prompt")
        return self.tokenizer.encode(prompt, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(ids)

    def chat_ids(self, req: ChatCompletionRequest, tools: ToolRequest | None) -> list[int]:
        if self.tokenizer is None:
            raise ApiError(400, "This model has no tokenizer and cannot chat.", param="messages")
        return chat_prompt_ids(self.tokenizer, req.messages, tools)

    @staticmethod
    def sampling_params(
        req: CompletionRequest | ChatCompletionRequest, max_tokens: int, logprobs: int | None
    ) -> SamplingParams:
        try:
            return sampling_params(req, max_tokens, logprobs)
        except InvalidParameter as exc:
            raise invalid_parameter(exc) from None

    async def start(
        self, request_id: str, prompt: list[int], params: SamplingParams, salt: str | None
    ) -> RequestStream:
        if self.peer is not None:
            await self.peer.prepare(prompt, params, salt)
        try:
            return await self.engine.add_request(request_id, prompt, params, salt)
        except InvalidParameter as exc:
            raise invalid_parameter(exc) from None
        except EngineDeadError as exc:
            raise ApiError(503, str(exc), type="server_error", code="engine_unavailable") from None

    async def final_output(self, request: Request, stream: RequestStream) -> RequestOutput:
        """Wait for the last output, aborting the request if the client disconnects meanwhile."""
        task = asyncio.ensure_future(_last_output(stream))
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    raise ClientGone
        except EngineError as exc:
            raise ApiError(500, str(exc), type="server_error", code="engine_error") from None
        finally:
            task.cancel()
            stream.close()

    def event_stream(self, stream: RequestStream, events: AsyncIterator[dict[str, Any]]) -> _EventStream:
        async def body() -> AsyncIterator[bytes]:
            try:
                async for event in events:
                    yield sse.event(event)
            except EngineError as exc:
                yield sse.error_event(str(exc), "engine_error")
            except Exception as exc:
                log.exception("stream failed")
                yield sse.error_event(f"internal error: {type(exc).__name__}", "internal_error")
            yield sse.DONE

        return _EventStream(body(), stream.close)

    # --- endpoints -----------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        req = parse_request(EngineCompletionRequest, await self.read_body(request))
        lora = self.generation_model(req.model)
        check_fields(req)
        prompt = req.prompt_input()
        ids = await self.in_tokenizer_thread(self.encode, prompt) if isinstance(prompt, str) else prompt
        params = self.sampling_params(req, req.resolved_max_tokens(), req.logprobs)
        params.lora = lora
        echo = None
        if req.echo:
            text = prompt if isinstance(prompt, str) else await self.in_tokenizer_thread(self.decode, prompt)
            echo = Echo(text, req.logprobs is not None)
        shaper = CompletionShaper(
            completion_id("cmpl", request),
            lora.name if lora else self.model_name,
            self.texts,
            req.include_usage,
            echo,
        )
        stream = await self.start(shaper.id, ids, params, req.cache_salt)
        if req.stream:
            return self.event_stream(stream, shaper.chunks(stream))
        return JSONResponse(shaper.response(await self.final_output(request, stream)))

    async def chat_completions(self, request: Request) -> Response:
        req = parse_request(EngineChatRequest, await self.read_body(request))
        lora = self.generation_model(req.model)
        check_fields(req)
        top = req.logprobs_k()
        asks = requested_pins(req, self.engine.engine.config)
        tools = request_tools(req, self.tokenizer)
        ids = await self.in_tokenizer_thread(self.chat_ids, req, tools)
        room = self.engine.longest_request - len(ids)
        params = self.sampling_params(req, req.resolved_max_tokens(room), top)
        params.structured = answer_constraint(tools, params.structured)
        params.lora = lora
        params.skip_special_tokens = not (tools and tools.calls_possible and tools.special)
        if asks:
            params.pins = await self.in_tokenizer_thread(pin_requests, self.tokenizer, req, tools, ids, asks)
        shaper = ChatShaper(
            completion_id("chatcmpl", request),
            lora.name if lora else self.model_name,
            self.texts,
            req.include_usage,
            top,
            tools if tools is not None and tools.calls_possible else None,
        )
        stream = await self.start(shaper.id, ids, params, req.cache_salt)
        if req.stream:
            return self.event_stream(stream, shaper.chunks(stream))
        return JSONResponse(shaper.response(await self.final_output(request, stream)))

    def model_card(self) -> dict[str, Any]:
        return {
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "cachegw",
            "max_model_len": self.engine.max_model_len,
        }  # fmt: skip

    async def list_models(self) -> dict[str, Any]:
        adapters = adapter_cards(self.engine.engine.runner.loras, self.model_name, self.created)
        return {"object": "list", "data": [self.model_card(), *adapters]}

    async def get_model(self, model: str) -> dict[str, Any]:
        if self.generation_model(model) is None:
            return self.model_card()
        return next(c for c in (await self.list_models())["data"] if c["id"] == model)

    async def health(self) -> Response:
        if not self.engine.is_alive:
            return JSONResponse(error_body("The engine is not running.", "server_error"), status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics_text(self) -> Response:
        content, content_type = self.metrics.render()
        return Response(content, media_type=content_type)


# --- app -------------------------------------------------------------------------------------


def build_app(
    engine: AsyncEngine, served_model_name: str, max_request_bytes: int, admin_token: str = ""
) -> FastAPI:
    """The HTTP app over a running AsyncEngine (the caller owns the engine and shuts it down)."""
    app = FastAPI(title="cachegw backend", docs_url=None, redoc_url=None, openapi_url=None)
    server = _Server(engine, served_model_name, max_request_bytes)
    app.state.server = server
    install_error_handlers(app)
    role = engine.engine.config.role
    prefill = role == "prefill"  # computes prompts for decode engines, answers no completions
    chat = prefill_only if prefill else server.chat_completions
    app.add_api_route("/v1/completions", prefill_only if prefill else server.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat, methods=["POST"])
    if role != "decode" and engine.engine.kv_tier is not None and engine.engine.kv_tier.stores:
        prefill_id = lambda request: completion_id("prefill", request)  # noqa: E731
        app.add_api_route(PREFILL_PATH, prefill_route(server, prefill_id), methods=["POST"])
    app.add_api_route("/v1/embeddings", EmbeddingsEndpoint(server).create, methods=["POST"])
    app.add_api_route("/v1/models", server.list_models, methods=["GET"])
    app.add_api_route("/v1/models/{model:path}", server.get_model, methods=["GET"])
    app.add_api_route("/health", server.health, methods=["GET"])
    add_health_routes(app, lambda: engine.is_alive)
    app.add_api_route("/metrics", server.metrics_text, methods=["GET"])
    add_lora_routes(app, engine, admin_token, max_request_bytes)
    app.add_api_route("/tokenize", tokenize_route(server), methods=["POST"])  # vLLM's; routing = "kv" asks it
    return app


def default_served_name(model: str) -> str:
    """'SmolLM2-135M-Instruct' for the embedded model; else the file or folder name, minus a quant tag."""
    name = Path(model or EMBEDDED_GGUF).name.removesuffix(".gguf")
    return re.sub(r"[.-](I?Q\d\w*|BF16|F16|F32)$", "", name, flags=re.IGNORECASE) or name


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def run_backend(
    engine_cfg: EngineConfig,
    config_path: str | None = None,
    host: str | None = None,
    port: int | None = None,
    threads: ThreadPlan | None = None,
) -> None:
    """Load the engine, then serve until interrupted (the `cachegw backend` command, which has read
    the config and settled the threads already)."""
    from cachegw.backend.core.engine import LLMEngine
    from cachegw.backend.executor.cpu_threads import set_threads

    server_cfg = load_backend_server_config(config_path)
    if threads is not None:
        set_threads(threads)
    engine = AsyncEngine(LLMEngine(engine_cfg))
    name = server_cfg.served_model_name or default_served_name(engine_cfg.model)
    app = build_app(engine, name, server_cfg.max_request_bytes, server_cfg.admin_token)
    host = host or server_cfg.host
    port = server_cfg.port if port is None else port
    log.info("serving %s at %s/v1 (health %s/health, metrics %s/metrics)", name, *[_url(host, port)] * 3)
    # uvicorn handles SIGTERM by stopping, then raises it again with the handler it found: the default
    # one would end the process before the engine writes its KV blocks to the tier (``LLMEngine.close``).
    signal.signal(signal.SIGTERM, _exit_after_serving)
    try:
        # uvicorn's loggers left to the root handler `cachegw backend` set up (level and format flags)
        uvicorn.run(app, host=host, port=port, log_config=None, log_level=None)
    finally:
        engine.shutdown(timeout=engine_cfg.kv_shutdown_budget_s + 10.0)


def _exit_after_serving(signum: int, frame: object) -> None:
    raise SystemExit(0)
