"""Asyncio front of the LLMEngine: one thread steps the engine, coroutines await its outputs.

The engine is not thread-safe, so only the loop thread ever touches it: adds and aborts are
queued as commands and applied between steps, and outputs travel back to each request's
asyncio.Queue through ``loop.call_soon_threadsafe``. The thread sleeps on an Event when there is
nothing to do.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import TypeVar

from cachegw.backend.core.engine import EngineStats, LLMEngine
from cachegw.backend.core.outputs import RequestOutput
from cachegw.backend.core.sampling_params import SamplingParams

log = logging.getLogger("cachegw.backend")

FinishListener = Callable[[RequestOutput], None]
T = TypeVar("T")


class EngineError(RuntimeError):
    """The engine failed while this request was running; other requests keep going."""


class EngineDeadError(EngineError):
    """The engine loop has been shut down."""


class RequestStream:
    """Outputs of one request, in order. Closing it before the end aborts the request.

    Cancellation while waiting (client disconnect) aborts too, so the request's KV blocks are
    freed even when nobody calls ``close``.
    """

    def __init__(self, engine: AsyncEngine, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.engine = engine
        self.request_id = request_id
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

    def put(self, item: RequestOutput | BaseException) -> None:
        """Called from the engine thread."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening any more
            pass

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            item = await self.queue.get()
        except BaseException:
            self.close()
            raise
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def close(self) -> None:
        """Abort the request unless it already finished; safe to call more than once."""
        if not self.finished:
            self.finished = True
            self.engine._submit(partial(self.engine._abort, self.request_id, self))

    async def aclose(self) -> None:
        self.close()


class AsyncEngine:
    """Runs ``LLMEngine.step`` in a background thread and serves many asyncio consumers."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.num_aborted = 0  # requests aborted because their consumer went away
        self.num_failed = 0  # requests failed by an engine error
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._listeners: list[FinishListener] = []
        self._stats = engine.stats()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="cachegw-engine", daemon=True)
        self._thread.start()

    # --- caller side (any thread / event loop) -------------------------------------------------

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def kv_cache_tokens(self) -> int:
        return self.engine.kv_cache_tokens

    @property
    def longest_request(self) -> int:
        return self.engine.longest_request

    @property
    def is_alive(self) -> bool:
        return not self._stopped and self._thread.is_alive()

    def stats(self) -> EngineStats:
        """The snapshot taken by the loop thread after its last step (never reads the engine live)."""
        return self._stats

    def add_finish_listener(self, listener: FinishListener) -> None:
        """Call ``listener(output)`` (in the engine thread) for every request that finishes."""
        self._listeners.append(listener)

    async def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, cache_salt: str | None = None
    ) -> RequestStream:
        """Queue a request and wait until the engine accepted it.

        Raises the engine's validation error (InvalidParameter, ContextLengthExceeded) so the
        caller can reject the request before it starts answering.
        """
        if self._stopped:
            raise EngineDeadError("the engine is shut down")
        loop = asyncio.get_running_loop()
        stream = RequestStream(self, request_id, loop)
        accepted: asyncio.Future[None] = loop.create_future()
        self._submit(partial(self._add, stream, prompt, params, cache_salt, time.time(), accepted))
        try:
            await accepted
        except asyncio.CancelledError:
            stream.close()  # applied after the add: commands run in order
            raise
        except BaseException:
            stream.finished = True  # never added: nothing to abort
            raise
        return stream

    async def generate(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, cache_salt: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as they come; closing the generator early aborts it."""
        stream = await self.add_request(request_id, prompt, params, cache_salt)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    async def run_between_steps(self, fn: Callable[[LLMEngine], T]) -> T:
        """``fn(engine)`` in the loop thread, between two steps, and its result (or its exception).

        For work on the model outside the scheduler (an embeddings forward): it never overlaps a step
        and holds the loop for as long as it runs, so callers keep each call about one step's size."""
        if self._stopped:
            raise EngineDeadError("the engine is shut down")
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()

        def settle(result: T | None, exc: BaseException | None) -> None:
            if done.done():
                return
            if exc is None:
                done.set_result(result)  # type: ignore[arg-type]
            else:
                done.set_exception(exc)

        def command() -> None:
            try:
                result, exc = fn(self.engine), None
            except Exception as e:
                result, exc = None, e
            try:
                loop.call_soon_threadsafe(settle, result, exc)
            except RuntimeError:  # the caller's loop is closed: nobody waits any more
                pass

        self._submit(command)
        return await done

    def abort(self, request_id: str) -> None:
        """Abort a request by id (no-op when it is unknown or done)."""
        self._submit(partial(self._abort, request_id, None))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop thread; requests still running fail with EngineDeadError."""
        if self._stopped:
            return
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout)

    def _submit(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._wake.set()

    # --- engine thread -------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopped:
            self._wake.clear()  # before draining: a command queued after this sets it again
            self._apply_commands()
            if self.engine.has_unfinished_requests():
                self._step()
            else:
                self._stats = self.engine.stats()
                self._wake.wait()
        self._apply_commands()
        for request_id, stream in list(self._streams.items()):
            self._safe_abort(request_id)
            stream.put(EngineDeadError("the engine was shut down"))
        self._streams.clear()
        self._stats = self.engine.stats()
        self.engine.close()

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                command()
            except Exception:  # a command must never take the loop down
                log.exception("engine command failed")

    def _add(
        self,
        stream: RequestStream,
        prompt: str | list[int],
        params: SamplingParams,
        cache_salt: str | None,
        arrival_time: float,
        accepted: asyncio.Future[None],
    ) -> None:
        try:
            self.engine.add_request(stream.request_id, prompt, params, cache_salt, arrival_time)
        except Exception as exc:
            self._resolve(stream, accepted, exc)
            return
        self._streams[stream.request_id] = stream
        self._resolve(stream, accepted, None)

    @staticmethod
    def _resolve(stream: RequestStream, fut: asyncio.Future[None], exc: BaseException | None) -> None:
        def settle() -> None:
            if fut.done():
                return
            if exc is None:
                fut.set_result(None)
            else:
                fut.set_exception(exc)

        try:
            stream.loop.call_soon_threadsafe(settle)
        except RuntimeError:
            pass

    def _abort(self, request_id: str, stream: RequestStream | None) -> None:
        """Abort only the request the stream belongs to (ids are not reused, but be exact)."""
        current = self._streams.get(request_id)
        if current is None or (stream is not None and current is not stream):
            return
        del self._streams[request_id]
        if self._safe_abort(request_id):
            self.num_aborted += 1
        self._stats = self.engine.stats()

    def _safe_abort(self, request_id: str) -> bool:
        try:
            return self.engine.abort_request(request_id)
        except Exception:
            log.exception("aborting %s failed", request_id)
            return False

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            log.exception("engine step failed")
            self._fail_running(exc)
            return
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if out.finished:
                self._streams.pop(out.request_id, None)
                self._notify(out)
            if stream is not None:
                stream.put(out)
        self._stats = self.engine.stats()

    def _fail_running(self, exc: Exception) -> None:
        """Fail the requests the broken step was running; if none were, everything queued.

        A step's batch is drawn from the running set, so the waiting requests were not part of
        it and keep their chance. If nothing was running the failure came from scheduling
        itself and would repeat forever, so everyone fails. Requests the step already finished
        and dropped before it broke lost their final output: they fail too rather than hang.
        """
        running = [s.request_id for s in self.engine.scheduler.running]
        orphans = [rid for rid in self._streams if rid not in self.engine.requests]
        victims = list(dict.fromkeys((running or list(self.engine.requests)) + orphans))  # samples share ids
        error = EngineError(f"the engine failed while running this request: {type(exc).__name__}: {exc}")
        for request_id in victims:
            self._safe_abort(request_id)
            self.num_failed += 1
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.put(error)
        self._stats = self.engine.stats()

    def _notify(self, out: RequestOutput) -> None:
        for listener in self._listeners:
            try:
                listener(out)
            except Exception:
                log.exception("finish listener failed")
