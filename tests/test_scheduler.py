"""The server's scheduler: one slot, a bounded FIFO queue, deadlines, cancellation, shutdown.

Each test drives `Scheduler` on its own event loop with plain asyncio tasks (no HTTP, no model).
"""

from __future__ import annotations

import asyncio
import math

import pytest

from d3d.scheduler import DeadlineExceeded, QueueFull, Scheduler, Unavailable


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 10))


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_requests_get_the_slot_in_arrival_order():
    """The first request takes the free slot at once; the others wait and get it first come, first served."""
    async def scenario():
        scheduler, order = Scheduler(max_queue=4), []
        assert await scheduler.acquire() == 0.0 and scheduler.busy

        async def request(name: str) -> None:
            await scheduler.acquire()
            order.append(name)

        tasks = [asyncio.create_task(request(name)) for name in "abc"]
        await settle()
        assert scheduler.queue_depth == 3 and order == []
        for expected in ("a", "b", "c"):
            scheduler.release()
            await settle()
            assert order[-1] == expected
        scheduler.release()
        await asyncio.gather(*tasks)
        assert not scheduler.busy and scheduler.idle.is_set() and scheduler.queue_depth == 0

    run(scenario())


def test_a_full_queue_refuses_at_once_with_a_retry_time():
    async def scenario():
        scheduler = Scheduler(max_queue=2)
        await scheduler.acquire()
        waiting = [asyncio.create_task(scheduler.acquire()) for _ in range(2)]
        await settle()
        with pytest.raises(QueueFull) as refused:
            await scheduler.acquire()
        assert refused.value.retry_after >= 1 and "2 requests are already waiting" in str(refused.value)
        counts = [scheduler.waiting_count()]  # what the engine's batch reads as its backlog
        for _ in range(3):
            scheduler.release()
            await settle()
            counts.append(scheduler.waiting_count())
        await asyncio.gather(*waiting)
        assert counts == [2, 1, 0, 0]

    run(scenario())


def test_no_queue_means_busy_is_refused():
    async def scenario():
        scheduler = Scheduler(max_queue=0)
        await scheduler.acquire()
        with pytest.raises(QueueFull):
            await scheduler.acquire()
        scheduler.release()
        assert await scheduler.acquire() == 0.0

    run(scenario())


def test_a_deadline_passing_in_the_queue_gives_up_and_frees_the_place():
    async def scenario():
        scheduler = Scheduler(max_queue=1)
        await scheduler.acquire()
        with pytest.raises(DeadlineExceeded):
            await scheduler.acquire(timeout=0.05)
        assert scheduler.queue_depth == 0
        follower = asyncio.create_task(scheduler.acquire(timeout=5))
        await settle()
        scheduler.release()
        assert await follower > 0  # the place freed by the expired request was usable

    run(scenario())


def test_a_cancelled_wait_leaves_the_queue_and_never_holds_the_slot():
    """A request cancelled while it waits (its client left) is skipped: the next one gets the slot."""
    async def scenario():
        scheduler = Scheduler(max_queue=3)
        await scheduler.acquire()
        leaving = asyncio.create_task(scheduler.acquire())
        staying = asyncio.create_task(scheduler.acquire())
        await settle()
        leaving.cancel()
        await settle()
        assert scheduler.queue_depth == 1
        scheduler.release()
        await staying
        scheduler.release()
        assert not scheduler.busy

    run(scenario())


def test_cancelled_in_the_instant_it_was_handed_the_slot_passes_it_on():
    async def scenario():
        scheduler = Scheduler(max_queue=3)
        await scheduler.acquire()
        unlucky = asyncio.create_task(scheduler.acquire())
        await settle()
        scheduler.release()  # the slot goes to `unlucky`, whose task has not resumed yet
        unlucky.cancel()
        with pytest.raises(asyncio.CancelledError):
            await unlucky
        assert not scheduler.busy and scheduler.idle.is_set()

    run(scenario())


def test_closing_sends_the_queue_away_and_refuses_newcomers():
    async def scenario():
        scheduler = Scheduler(max_queue=3)
        await scheduler.acquire()
        waiting = asyncio.create_task(scheduler.acquire())
        await settle()
        scheduler.close()
        with pytest.raises(Unavailable):
            await waiting
        with pytest.raises(Unavailable):
            await scheduler.acquire()
        assert scheduler.busy  # the running generation keeps its slot until it ends
        scheduler.release()
        await asyncio.wait_for(scheduler.idle.wait(), 1)

    run(scenario())


def test_retry_after_grows_with_the_queue_and_the_recent_hold_time():
    async def scenario():
        scheduler = Scheduler(max_queue=8)
        await scheduler.acquire()
        await asyncio.sleep(0.3)
        scheduler.release()  # one generation held the slot ~0.3 s
        await scheduler.acquire()
        alone = scheduler.retry_after()
        waiting = [asyncio.create_task(scheduler.acquire()) for _ in range(7)]
        await settle()
        held = scheduler.durations[-1]
        assert held >= 0.3 and alone == 1 and scheduler.retry_after() == math.ceil(held * 8)  # 8 ahead
        for _ in range(8):
            scheduler.release()
            await settle()
        await asyncio.gather(*waiting)

    run(scenario())


def test_max_queue_must_not_be_negative():
    with pytest.raises(ValueError, match="max_queue"):
        Scheduler(max_queue=-1)
