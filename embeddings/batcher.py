"""Micro-batching of concurrent embedding requests.

One MiniLM call costs about 4-5 ms for one sentence and about 1 ms per sentence for 64 (measured-facts.md),
so concurrent lookups are gathered for at most ``window_ms`` (or until ``max_batch``) and embedded in one
encoder call on a single worker thread, keeping the event loop free. While a batch is being encoded, new
requests queue and go out together as soon as the encoder is free: under load batches grow by themselves
instead of piling up small ones behind each other.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np


class SupportsEncode(Protocol):
    dim: int

    def encode(self, texts: list[str]) -> np.ndarray: ...


_Pending = tuple[str, "asyncio.Future[np.ndarray]"]


class EmbeddingBatcher:
    """Coalesces ``embed`` calls into batched ``encoder.encode`` calls.

    Not thread-safe: use it from one event loop (the gateway's); the encoder runs on its own worker thread.
    """

    def __init__(self, encoder: SupportsEncode, window_ms: float = 2.0, max_batch: int = 64) -> None:
        if window_ms < 0:
            raise ValueError(f"window_ms must be >= 0, got {window_ms}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self._encoder = encoder
        self._window_s = window_ms / 1000.0
        self._max_batch = max_batch
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embed")
        self._pending: list[_Pending] = []
        self._timer: asyncio.TimerHandle | None = None
        self._busy = False
        self._closed = False
        self._tasks: set[asyncio.Task[None]] = set()
        self.batches = 0  # encoder calls made
        self.texts = 0  # texts embedded

    async def embed(self, text: str) -> np.ndarray:
        """Unit-norm float32 embedding of ``text``; waits at most the window before its batch is sent."""
        return await self._submit(text)

    async def embed_many(self, texts: Sequence[str]) -> np.ndarray:
        """[n, dim] embeddings; the texts join the shared queue, so they batch with other callers too."""
        futures = [self._submit(t) for t in texts]
        if not futures:
            return np.zeros((0, self._encoder.dim), dtype=np.float32)
        return np.stack(await asyncio.gather(*futures))

    def close(self) -> None:
        """Refuse new work and fail queued requests; a batch already encoding still delivers its results."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        pending, self._pending = self._pending, []
        for _, fut in pending:
            if not fut.done():
                fut.set_exception(RuntimeError("EmbeddingBatcher is closed"))
        self._executor.shutdown(wait=False)

    @property
    def mean_batch(self) -> float:
        return self.texts / self.batches if self.batches else 0.0

    # ---- internals ----------------------------------------------------------------------------------------

    def _submit(self, text: Any) -> asyncio.Future[np.ndarray]:
        if self._closed:
            raise RuntimeError("EmbeddingBatcher is closed")
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[np.ndarray] = loop.create_future()
        self._pending.append((text, fut))
        if self._busy:
            pass  # the running batch dispatches the queue when it finishes
        elif len(self._pending) >= self._max_batch:
            self._dispatch()
        elif self._timer is None:
            self._timer = loop.call_later(self._window_s, self._dispatch)
        return fut

    def _dispatch(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._busy or self._closed:
            return
        batch = [(t, f) for t, f in self._pending[: self._max_batch] if not f.done()]  # drop cancelled
        self._pending = self._pending[self._max_batch :]
        if not batch:
            if self._pending:
                self._dispatch()
            return
        self._busy = True
        task = asyncio.get_running_loop().create_task(self._run(batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, batch: list[_Pending]) -> None:
        texts = [t for t, _ in batch]
        try:
            loop = asyncio.get_running_loop()
            vecs = await loop.run_in_executor(self._executor, self._encoder.encode, texts)
            if getattr(vecs, "shape", None) is None or vecs.shape[0] != len(texts):
                raise RuntimeError(f"encoder returned {getattr(vecs, 'shape', None)} for {len(texts)} texts")
        except asyncio.CancelledError:  # the loop is shutting down: nobody will read the results
            for _, fut in batch:
                fut.cancel()
            self._finish()
            raise
        except Exception as exc:  # every caller of the batch sees the encoder's failure
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(exc)
            self._finish()
            return
        self.batches += 1
        self.texts += len(texts)
        for (_, fut), vec in zip(batch, vecs, strict=True):
            if not fut.done():
                fut.set_result(np.array(vec, dtype=np.float32, copy=True))
        self._finish()

    def _finish(self) -> None:
        """Free the encoder slot and immediately send what queued up meanwhile."""
        self._busy = False
        if self._pending and not self._closed:
            self._dispatch()
