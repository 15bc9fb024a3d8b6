"""The queue is bounded by the wait it would impose, measured from how fast it drains, not
by a small count: a request is refused (429, Retry-After from the same pace) only when it
would wait longer than the server allows."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from test_server import HELLO, TinyProvider, serving

from mlxspec.decoding.engine import GenerationSettings
from mlxspec.server import ServerLimits
from mlxspec.server.errors import ApiError
from mlxspec.server.queue_wait import DrainRate, retry_after
from mlxspec.server.worker import Generation, Worker


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_drain_rate_is_measured_up_to_now():
    clock = Clock()
    drain = DrainRate(clock=clock)
    assert drain.per_second() is None and drain.expected_wait(5) is None  # nothing known
    for _ in range(3):  # three ends a second apart: two intervals in two seconds
        drain.ended()
        clock.now += 1.0
    clock.now -= 1.0
    assert drain.per_second() == pytest.approx(1.0)
    assert drain.expected_wait(5) == pytest.approx(5.0) and drain.expected_wait(0) == 0.0
    clock.now += 2.0  # a queue that stopped draining reads slower
    assert drain.per_second() == pytest.approx(0.5)


def test_retry_after_is_when_the_wait_falls_under_the_bound():
    assert retry_after(12.2, 5.0) == 8 and retry_after(5.5, 5.0) == 1 and retry_after(1, 5) == 1


def generation() -> Generation:
    return Generation("tiny", HELLO[0]["content"], GenerationSettings(max_tokens=4), None)


async def submit_until_refused(worker: Worker, most: int) -> tuple[int, ApiError | None]:
    for accepted in range(most):
        try:
            worker.submit(generation())
        except ApiError as refused:
            return accepted, refused
    return most, None


def test_a_crowd_is_queued_until_its_wait_would_pass_the_bound():
    """A worker that is not serving yet (its queue only grows) at a measured pace of one
    request a second, allowed waits of 10 s: eleven are queued (waits of 0 to 10 s), the
    twelfth is refused, told to come back when the wait will have fallen to 10 s. With the
    pace unknown, a crowd of 500 is queued whole."""
    worker = Worker(TinyProvider(), max_waiting=None)
    accepted, refused = asyncio.run(submit_until_refused(worker, 500))
    assert (accepted, refused) == (500, None)

    worker = Worker(TinyProvider(), max_waiting=None)
    worker.max_queue_wait = 10.0
    clock = Clock()
    worker.drain = DrainRate(clock=clock)
    for _ in range(5):
        worker.drain.ended()
        clock.now += 1.0
    clock.now -= 1.0  # four intervals in four seconds: 1 request/s
    accepted, refused = asyncio.run(submit_until_refused(worker, 100))
    assert accepted == 11 and refused.status_code == 429 and refused.code == "queue_full"
    assert refused.headers["Retry-After"] == "1"  # 11 s of wait, 10 allowed
    assert "about 11 s of work" in refused.message

    capped = Worker(TinyProvider(), max_waiting=3)  # an explicit cap still holds
    accepted, refused = asyncio.run(submit_until_refused(capped, 100))
    assert accepted == 3 and refused.headers["Retry-After"]


def test_health_reports_the_queues_expected_wait():
    with serving(TinyProvider(), limits=ServerLimits(max_queue_wait=42.0)) as url:
        health = httpx.get(f"{url}/health").json()
        assert health["max_queue_wait_s"] == 42.0 and "expected_wait_s" in health
        for _ in range(2):
            body = {"messages": HELLO, "max_tokens": 2}
            assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30).is_success
        assert httpx.get(f"{url}/health").json()["expected_wait_s"] == 0.0  # none ahead


def test_a_request_whose_client_left_holds_nobody_up():
    """Requests cancelled while they wait are skipped when their turn comes: they count
    neither in the wait a new request would face nor against a cap."""
    worker = Worker(TinyProvider(), max_waiting=3)

    async def crowd_then_leave() -> tuple[int, ApiError | None]:
        jobs = [worker.submit(generation()) for _ in range(3)]
        for job in jobs:
            job.cancel()
        return await submit_until_refused(worker, 3)

    accepted, refused = asyncio.run(crowd_then_leave())
    assert (accepted, refused) == (3, None)
