"""Who runs next, and on which thread: the server's generation slots with their bounded queue, and
the runners that make blocking engine calls from the event loop.

`Scheduler` admits `slots` generations at a time — one, or the continuous batch's width (`d3d.batch`:
the admitted generations decode together, each exactly as alone) — and keeps the others in a FIFO
queue of bounded length;
a request that finds the queue full is refused at once (`QueueFull`, an HTTP 429 with Retry-After),
one that waits past its deadline gives up (`DeadlineExceeded`), and a closed scheduler (shutting
down) refuses and releases everyone waiting (`Unavailable`). Everything runs on the event loop's
thread, so there are no locks: a waiting request is a future, cancelled when its task is.

It admits; the batching itself is `d3d.batch`'s.
"""

from __future__ import annotations

import asyncio
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import anyio.to_thread


class QueueFull(Exception):
    """Every queue place is taken: try again after `retry_after` seconds."""

    def __init__(self, waiting: int, retry_after: int) -> None:
        super().__init__(f"the server is busy: {waiting} requests are already waiting; retry in {retry_after} s")
        self.retry_after = retry_after


class DeadlineExceeded(Exception):
    """The request's deadline passed while it waited for the engine."""


class Unavailable(Exception):
    """The server is shutting down and takes no more generations."""


class Scheduler:
    """`slots` generation slots and a bounded FIFO queue in front of them (event-loop thread only)."""

    def __init__(self, max_queue: int, slots: int = 1) -> None:
        if max_queue < 0:
            raise ValueError(f"max_queue must be at least 0, got {max_queue}")
        if slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        self.max_queue = max_queue  # requests that may wait while every slot is held (0: none)
        self.slots = slots
        self.waiting: deque[asyncio.Future[None]] = deque()
        self.held = 0  # slots held by generations
        self.closed = False
        self.durations: deque[float] = deque(maxlen=32)  # recent slot hold times, for Retry-After
        self.held_since: deque[float] = deque()  # when each held slot was taken, oldest first
        self.idle = asyncio.Event()
        self.idle.set()

    @property
    def busy(self) -> bool:
        """Every slot is held."""
        return self.held >= self.slots

    @property
    def queue_depth(self) -> int:
        return sum(not future.done() for future in self.waiting)

    def waiting_count(self) -> int:
        """Requests in the queue, for any thread (the engine's batch asks): one read of its length,
        no iteration over a deque the event loop may be changing."""
        return len(self.waiting)

    def retry_after(self) -> int:
        """Seconds until a place is likely free: the queue ahead times the recent mean hold time
        (before any generation ended: the oldest running one's time so far), over the slots."""
        held = time.monotonic() - self.held_since[0] if self.held_since else 0.0
        mean = sum(self.durations) / len(self.durations) if self.durations else held
        return max(1, math.ceil(mean * (self.queue_depth + 1) / self.slots))

    async def acquire(self, timeout: float | None = None) -> float:
        """Wait for the slot (at most `timeout` seconds); returns the seconds waited.

        Raises `QueueFull` at once when `max_queue` requests already wait, `DeadlineExceeded` when
        `timeout` passes first, `Unavailable` once closed. A cancelled wait leaves the queue.
        """
        if self.closed:
            raise Unavailable("the server is shutting down")
        started = time.monotonic()
        if not self.busy and not self.queue_depth:
            self.take()
            return 0.0
        if self.queue_depth >= self.max_queue:
            raise QueueFull(self.queue_depth, self.retry_after())
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        self.waiting.append(future)
        expiry = None
        if timeout is not None:
            expiry = loop.call_later(max(0.0, timeout), expire, future, timeout)
        try:
            await future
        except BaseException:
            if future.done() and not future.cancelled() and future.exception() is None:
                self.release()  # handed the slot in the same instant the wait was cancelled
            raise
        finally:
            if expiry is not None:
                expiry.cancel()
            if future in self.waiting:
                self.waiting.remove(future)
        return time.monotonic() - started

    def take(self) -> None:
        self.held += 1
        self.held_since.append(time.monotonic())
        self.idle.clear()

    def release(self) -> None:
        """Free a slot: the longest-waiting request gets it, or it stays free (the scheduler idle
        once every slot is)."""
        self.durations.append(time.monotonic() - self.held_since.popleft())
        self.held -= 1
        while self.waiting:
            future = self.waiting.popleft()
            if not future.done():
                self.take()
                future.set_result(None)
                return
        if not self.held:
            self.idle.set()

    def close(self) -> None:
        """Take no more requests and send everyone waiting away (`Unavailable`)."""
        self.closed = True
        while self.waiting:
            future = self.waiting.popleft()
            if not future.done():
                future.set_exception(Unavailable("the server is shutting down"))


def expire(future: asyncio.Future[None], timeout: float) -> None:
    if not future.done():
        future.set_exception(DeadlineExceeded(f"the request's deadline ({timeout:.3g} s) passed while it waited"))


class WorkerThreads:
    """Blocking engine calls in anyio's worker threads: the default of `create_app`."""

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        # A cancelled request still waits for the worker thread (anyio does not abandon it),
        # so the engine is never left running when the slot is released.
        return await anyio.to_thread.run_sync(fn, *args)

    def close(self, chunks: Iterator[Any]) -> None:
        chunks.close()  # type: ignore[attr-defined]


class MainThread:
    """Blocking engine calls on the one thread that runs `work()` — the main thread under `serve`.

    On this CPU torch runs at one thread's speed when called from any other thread (measured: the
    same generation at 14.8 tok/s in a worker thread, 20.5 in the main thread), so `serve` keeps
    the engine on the main thread and runs the HTTP event loop beside it. Calls run one after
    another in submission order, so closing a generation (queued too) never races a step of it.
    """

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def settle(ok: bool, value: Any) -> None:
            if not future.done():
                future.set_result(value) if ok else future.set_exception(value)

        def job() -> None:
            try:
                outcome = (True, fn(*args))
            except Exception as error:  # handed to the request, which answers with it
                outcome = (False, error)
            except BaseException as error:  # Ctrl-C during a generation stops the server, not one request
                loop.call_soon_threadsafe(settle, False, error)
                raise
            loop.call_soon_threadsafe(settle, *outcome)

        self.jobs.put(job)
        return await future

    def close(self, chunks: Iterator[Any]) -> None:
        self.jobs.put(chunks.close)  # type: ignore[attr-defined]

    def work(self, done: threading.Event) -> None:
        """Run submitted calls until `done` is set."""
        while not done.is_set():
            try:
                job = self.jobs.get(timeout=0.1)
            except queue.Empty:
                continue
            job()
