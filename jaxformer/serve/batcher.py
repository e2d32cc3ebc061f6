"""Dynamic batching for one served model (:class:`Batcher`): the sentences of concurrent
requests that decode alike are gathered into one engine call.

A call starts when a worker is free and the oldest waiting sentence has waited ``wait_s`` (or
``max_sentences`` wait); it takes up to ``max_sentences`` sentences, oldest first, of requests
with the oldest's decoding options, splitting a large request over calls. Calls run on the
engine's own worker threads (``workers`` at once: CTranslate2's translators; JAX's one device
thread), never on the event loop. A request with per-sentence options (constraints, a prefix)
is a call of its own. An engine error fails the requests of that call only: a call of several
requests is retried one request at a time, so only the request that breaks the engine fails.
More than ``max_queue`` waiting sentences: :class:`QueueFull`. A request cancelled while
waiting (its client went away) leaves the queue. Mirrors Triton's and TF-Serving's batchers
(a delay bound and a size bound), with engine calls in threads as CTranslate2's
``translate_batch`` wants.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from jaxformer.decode.engine import Request, Translation


class QueueFull(Exception):
    """More sentences wait than the batcher holds: answer 503 and ask the client to retry."""


@dataclasses.dataclass(eq=False)
class _Job:
    sentences: Sequence[str]
    request: Request
    key: Hashable
    future: asyncio.Future
    arrived: float
    results: list[Translation | None]
    alone: bool = False
    sent: int = 0      # sentences handed to calls so far
    done: int = 0      # sentences translated so far


class Batcher:
    """Gathers :meth:`translate` requests into calls of ``call(sentences, request)`` (an engine's
    ``translate``) on ``workers`` threads (module docstring). ``on_call(n)`` is told each call's
    sentence count, ``on_error()`` each failed call (metrics)."""

    def __init__(self, call: Callable[[list[str], Request], list[Translation]], *, wait_s: float,
                 max_sentences: int, max_queue: int, workers: int = 1, name: str = "engine",
                 on_call: Callable[[int], None] | None = None, on_error: Callable[[], None] | None = None):
        self.call, self.wait_s, self.max_sentences, self.max_queue = call, wait_s, max_sentences, max_queue
        self.workers, self.on_call, self.on_error = workers, on_call, on_error
        self.executor = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix=f"{name}-engine")
        self.waiting = 0   # sentences not yet handed to a call
        self._jobs: collections.deque[_Job] = collections.deque()
        self._wake = asyncio.Event()
        self._free = asyncio.Semaphore(workers)
        self._loop_task: asyncio.Task | None = None
        self._calls: set[asyncio.Task] = set()

    def start(self) -> None:
        """Starts gathering (on the running event loop)."""
        self._loop_task = asyncio.get_running_loop().create_task(self._gather())

    async def close(self) -> None:
        """Waits for the calls under way, stops gathering and the threads."""
        if self._calls:
            await asyncio.gather(*self._calls, return_exceptions=True)
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        self.executor.shutdown(wait=True)

    async def run(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on the engine's threads (a call outside the batches, e.g. an attention map)."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn)

    async def translate(self, sentences: Sequence[str], request: Request, *,
                        alone: bool = False) -> list[Translation]:
        """The translations of ``sentences`` under ``request``, gathered with other requests'
        (``alone``: in a call of its own, whole). Raises :class:`QueueFull`, or the engine's
        error for a request it fails."""
        if not sentences:
            return []
        if self.waiting and self.waiting + len(sentences) > self.max_queue:
            raise QueueFull(f"{self.waiting} sentences are waiting")
        loop = asyncio.get_running_loop()
        job = _Job(sentences, request, object() if alone else request, loop.create_future(),
                   time.monotonic(), [None] * len(sentences), alone)
        self._jobs.append(job)
        self.waiting += len(sentences)
        self._wake.set()
        try:
            return await job.future
        except asyncio.CancelledError:   # the client went away: what has not started never will
            if job in self._jobs:
                self._jobs.remove(job)
                self.waiting -= len(job.sentences) - job.sent
            raise

    async def _gather(self) -> None:
        while True:
            await self._free.acquire()
            while not self._jobs:
                self._wake.clear()
                await self._wake.wait()
            delay = self._jobs[0].arrived + self.wait_s - time.monotonic()
            if delay > 0 and self._ready() < self.max_sentences:
                await asyncio.sleep(delay)
            parts = self._take()
            if not parts:   # cancelled while the window was open
                self._free.release()
                continue
            task = asyncio.get_running_loop().create_task(self._call(parts))
            self._calls.add(task)
            task.add_done_callback(self._calls.discard)

    def _ready(self) -> int:
        """Sentences waiting with the oldest request's options."""
        key = self._jobs[0].key
        return sum(len(job.sentences) - job.sent for job in self._jobs if job.key == key)

    def _take(self) -> list[tuple[_Job, int, int]]:
        """Up to ``max_sentences`` waiting sentences with the oldest's options: (job, start, end)."""
        if not self._jobs:
            return []
        key, room, parts = self._jobs[0].key, self.max_sentences, []
        for job in list(self._jobs):
            if job.key != key or (room <= 0 and parts):
                continue
            take = len(job.sentences) - job.sent
            take = take if job.alone else min(room, take)
            parts.append((job, job.sent, job.sent + take))
            job.sent += take
            room -= take
            self.waiting -= take
            if job.sent == len(job.sentences):
                self._jobs.remove(job)
        return parts

    async def _call(self, parts: list[tuple[_Job, int, int]]) -> None:
        loop = asyncio.get_running_loop()
        try:
            sentences = [s for job, start, end in parts for s in job.sentences[start:end]]
            if self.on_call:
                self.on_call(len(sentences))
            try:
                results = await loop.run_in_executor(self.executor, self.call, sentences, parts[0][0].request)
            except Exception as error:   # noqa: BLE001 (an engine error is the request's answer)
                if self.on_error:
                    self.on_error()
                if len(parts) == 1:
                    self._fail(parts[0][0], error)
                else:   # each request alone: only the one that breaks the engine fails
                    for part in parts:
                        await self._retry(part)
                return
            for (job, start, end), offset in zip(parts, _offsets(parts)):
                self._deliver(job, start, results[offset:offset + end - start])
        finally:
            self._free.release()

    async def _retry(self, part: tuple[_Job, int, int]) -> None:
        job, start, end = part
        try:
            results = await asyncio.get_running_loop().run_in_executor(
                self.executor, self.call, list(job.sentences[start:end]), job.request)
        except Exception as error:   # noqa: BLE001
            self._fail(job, error)
        else:
            self._deliver(job, start, results)

    def _deliver(self, job: _Job, start: int, results: list[Translation]) -> None:
        job.results[start:start + len(results)] = results
        job.done += len(results)
        if job.done == len(job.sentences) and not job.future.done():
            job.future.set_result(job.results)

    def _fail(self, job: _Job, error: Exception) -> None:
        if job in self._jobs:   # its other sentences never start
            self._jobs.remove(job)
            self.waiting -= len(job.sentences) - job.sent
        if not job.future.done():
            job.future.set_exception(error)


def _offsets(parts: list[tuple[Any, int, int]]) -> list[int]:
    out, at = [], 0
    for _, start, end in parts:
        out.append(at)
        at += end - start
    return out
