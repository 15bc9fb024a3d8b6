"""A generation as every API dialect sees it: queued, its answer's parts as they come, its end.

Dialect-neutral: OpenAI chat, OpenAI completions and Anthropic messages each start an
`Answering` for their `Generation` and translate what it yields into their own shapes. It
queues the generation, cancels it when the client leaves (`_cancel_on_disconnect`), and
relays the worker's outputs: `PartsOf` (an output event and the answer parts its text
completed) until `Answered` (the Done, the whole parsed answer, the last parts).

A stream that must wait in line starts at once: its headers go out and an SSE comment
(`: waiting in queue, N ahead`) every WAIT_COMMENT_SECONDS until its first output is in,
so proxies and SDK read timeouts do not cut a client that is only waiting its turn. A
refusal (429, 503) is decided at submit, before any header, so it keeps its status; so is
a prompt the resident model cannot take (`Worker.check_fits`: 400 context_length_exceeded).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import Request

from mlxspec.markup.conversation import AnswerPart
from mlxspec.markup.output_parser import Answered, PartsOf
from mlxspec.server.errors import ApiError
from mlxspec.server.worker import Generation, Job, Worker

log = logging.getLogger("mlxspec.server")

# Server-sent events go out as they are made: no cache, no proxy buffering (nginx's header).
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# The tools a request named that no model here runs (hosted search, deferred tools): they
# are not shown to the model, and the response says which, in every dialect.
DROPPED_HEADER = "X-Mlxspec-Dropped-Tools"
# How often a stream waiting for its first output hears a comment: well inside the idle
# timeouts of proxies (nginx's 60 s) and SDKs, and rare enough to cost nothing.
WAIT_COMMENT_SECONDS = 5.0


def dropped_header(dropped: list[str] | tuple[str, ...]) -> dict[str, str]:
    if dropped:
        log.info("dropped tools no model here runs: %s", ", ".join(dropped))
    return {DROPPED_HEADER: ", ".join(dropped)} if dropped else {}


class Answering:
    """One queued generation. `await Answering.start(...)` returns once its first output is
    in, so an error found before any (a bad proposer, a prompt too long) raises ApiError
    there, in time for a real HTTP status; a stream returns sooner (`start`'s `stream`).
    Then iterate it (or await `answered()`) and `release()` it when done, whatever
    happened."""

    def __init__(self, job: Job, watcher: asyncio.Task, first: asyncio.Future, worker: Worker):
        self.job, self._watcher, self._first, self._worker = job, watcher, first, worker

    @classmethod
    async def start(
        cls, request: Request, worker: Worker, generation: Generation, stream: bool = False
    ) -> Answering:
        """Queue the generation (a refusal raises here) and wait for its first output.
        A `stream` waits at most WAIT_COMMENT_SECONDS, and not at all when others are
        ahead of it: its client then hears `waiting()`'s comments instead of silence."""
        job = worker.submit(generation)
        watcher = asyncio.create_task(_cancel_on_disconnect(request, job))
        first = asyncio.ensure_future(job.next())
        answering = cls(job, watcher, first, worker)
        try:
            if not stream:
                await first
            elif worker.ahead_of(job):  # it will wait: what can be checked now is, so that
                await asyncio.to_thread(worker.check_fits, generation)  # a 400 stays one
            else:  # nobody ahead, or already taken from the line
                await asyncio.wait({first}, timeout=WAIT_COMMENT_SECONDS)
            if first.done():
                _output(first.result())  # an error before any output: a real status
        except BaseException:
            answering.release()
            raise
        return answering

    async def waiting(self) -> AsyncIterator[str]:
        """SSE comments (which clients ignore) until the first output is in: one at once,
        then one every WAIT_COMMENT_SECONDS, saying how many requests are ahead. An error
        in its place (the server stopping, a prompt too long) raises here, before the
        dialect opens its stream, so the error is the stream's only event."""
        while not self._first.done():
            yield wait_comment(self._worker.ahead_of(self.job))
            await asyncio.wait({self._first}, timeout=WAIT_COMMENT_SECONDS)
        _output(self._first.result())

    async def __aiter__(self) -> AsyncIterator[PartsOf | Answered]:
        """Outputs up to and including Answered; ApiError when the generation failed or was
        cancelled after its first output (too late for a status: the dialect says so in its
        stream)."""
        item = _output(await self._first)
        while not isinstance(item, Answered):
            yield item
            item = _output(await self.job.next())
        yield item

    async def answered(self) -> Answered:
        """Wait for the whole answer."""
        async for item in self:
            if isinstance(item, Answered):
                return item
        raise AssertionError("a generation's outputs end with Answered")

    def release(self) -> None:
        self.job.cancel()  # a no-op once the job has ended
        self._watcher.cancel()
        self._first.cancel()  # a no-op once it is in


def wait_comment(ahead: int | None) -> str:
    """An SSE comment line for a stream still waiting: `ahead` requests before it in line
    (None: it has left the line, and its model is loading or its prompt filling)."""
    if ahead is None:
        return ": starting\n\n"
    return f": waiting in queue, {ahead} ahead\n\n"


def cancelled() -> ApiError:
    """A job that ended without an answer: its client left, or the server is stopping."""
    return ApiError(503, "the request was cancelled", code="cancelled", type="server_error")


def _output(item: object) -> PartsOf | Answered:
    if isinstance(item, ApiError):
        raise item
    if item is None:
        raise cancelled()
    return item


async def _cancel_on_disconnect(request: Request, job: Job) -> None:
    """The body has been read, so the next message comes when the client leaves (or the
    response is complete, when cancelling is a no-op)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.cancel()


async def dialect_events(
    answering: Answering,
    opening: Callable[[], Awaitable[list[str]]],
    part: Callable[[AnswerPart], list[str]],
    closing: Callable[[Answered], list[str]],
    failing: Callable[[ApiError], list[str]],
) -> AsyncIterator[str]:
    """A streamed answer in a dialect's events (Anthropic's, the Responses API's): comments
    while it waits, the `opening` ones (made once the model is at work), each part's, the
    `closing` ones at the end; an error after the stream began is too late for a status,
    so it ends the stream as `failing` says. The generation is released however the
    stream ends."""
    try:
        async for comment in answering.waiting():
            yield comment
        for event in await opening():
            yield event
        async for item in answering:
            for answer_part in item.parts:
                for event in part(answer_part):
                    yield event
            if isinstance(item, Answered):
                for event in closing(item):
                    yield event
    except ApiError as err:
        for event in failing(err):
            yield event
    finally:
        answering.release()
