"""One thread runs every generation, one request at a time, in the order they came.

MLX arrays and streams are not meant to be driven from several threads at once, and
one model fills the machine anyway. So requests wait in a bounded FIFO queue and a
single worker thread takes them in turn: it opens the requested model (one resident
at a time), runs `engine.stream`, reads each output event into answer parts (reasoning,
text, tool calls: `output_parser.AnswerReader`, with the model's tokenizer at hand) and
hands them to the request's asyncio queue on the event loop. A request whose client
went away is skipped while it waits, and stopped between two events while it runs; the
engine's generator is closed, which leaves its KV cache consistent for the next request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import mlx.core as mx

from mlxspec.decoding.engine import Engine, GenerationError, GenerationSettings
from mlxspec.events import OUTPUT_EVENTS, Done, Event
from mlxspec.markup.conversation import Conversation
from mlxspec.markup.fim import Infill
from mlxspec.markup.output_parser import AnswerReader
from mlxspec.server.errors import ApiError, refused
from mlxspec.server.providers import ModelProvider, OpenModel
from mlxspec.server.queue_wait import MAX_QUEUED_BYTES, DrainRate, retry_after
from mlxspec.structured.answer import AnswerConstraint, answer_grammar, grammar_problem
from mlxspec.structured.grammar import GrammarError

log = logging.getLogger("mlxspec.server")

# What a client may tell to retry after when the queue is full and its pace is not yet
# known; once it is, Retry-After comes from it (queue_wait.py).
RETRY_AFTER_SECONDS = 2
# The longest a request may expect to wait in line before it is refused (serve
# --max-queue-wait): SDKs time a request out after 10 minutes, agents after about as long.
MAX_QUEUE_WAIT = 300.0
RATE_WINDOW = 10.0  # seconds of output /health's tokens_per_second averages over


@dataclass(frozen=True)
class Generation:
    """Everything the worker needs to run one request."""

    model: str
    prompt: str | list[int] | Conversation | Infill  # a Conversation's answer is read into parts
    settings: GenerationSettings
    proposer: str | None  # None: the model's default
    # What the answer must match, made the settings' grammar once the model is open
    # (`constrained`): the grammar is written in the model's own markup.
    constraint: AnswerConstraint | None = None


def constrained(generation: Generation, tokenizer) -> Generation:
    """The generation with its constraint as the settings' grammar, for the model whose
    `tokenizer` is given; ApiError (400) naming the field where it cannot be written."""
    constraint = generation.constraint
    if constraint is None:
        return generation
    param = constraint.param
    try:
        grammar = answer_grammar(tokenizer, generation.prompt, constraint)
    except GrammarError as err:
        raise ApiError(400, f"{param}: {err}", code="invalid_value", param=param) from None
    # A tool's schema is first compiled here, in the model's markup: a keyword it would
    # ignore is refused, as response_format's are (checked once per grammar, then cached).
    problem = grammar_problem(grammar) if constraint.tools is not None else None
    if problem is not None:
        raise ApiError(400, f"{param}: {problem}", code="invalid_value", param=param)
    settings = dataclasses.replace(generation.settings, grammar=grammar)
    return dataclasses.replace(generation, settings=settings, constraint=None)


class Job:
    """One request's place in the queue, and its channel back to the event loop."""

    _END = object()

    def __init__(
        self,
        generation: Generation,
        loop: asyncio.AbstractEventLoop,
        on_end: Callable[[], None] | None = None,
    ):
        self.generation = generation
        self.size = prompt_bytes(generation.prompt)  # what it holds while it waits
        self._loop = loop
        self._on_end = on_end
        self._inbox: asyncio.Queue = asyncio.Queue()
        self._cancelled = threading.Event()
        self.reader: AnswerReader | None = None  # made by the worker at the first output

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def post(self, item: object) -> None:
        """Worker thread: hand an output (PartsOf, Answered) or an ApiError to the
        request's handler."""
        try:
            self._loop.call_soon_threadsafe(self._inbox.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self.cancel()

    def end(self) -> None:
        if self._on_end is not None:
            self._on_end, on_end = None, self._on_end
            on_end()
        self.post(self._END)

    async def next(self) -> object | None:
        """Event loop: the next PartsOf, Answered or ApiError; None once it has ended."""
        item = await self._inbox.get()
        return None if item is self._END else item


class Worker:
    def __init__(
        self, provider: ModelProvider, max_waiting: int | None, preload: str | None = None
    ):
        """`max_waiting`: a cap on queued requests (None: none; the queue is bounded by
        the wait it would impose, `max_queue_wait`, and by the memory its prompts hold)."""
        self.provider, self.max_waiting, self.preload = provider, max_waiting, preload
        self.max_queue_wait = MAX_QUEUE_WAIT
        self.drain = DrainRate()
        self.resident: str | None = None  # the model in memory
        self.busy = False
        self._model: OpenModel | None = None
        self._waiting: queue.Queue[Job | None] = queue.Queue()
        self._running: Job | None = None
        self._stopping = threading.Event()
        self._relayed: deque[tuple[float, int]] = deque()  # (when, output tokens)
        self.thread = threading.Thread(target=self._serve, name="mlxspec-generation", daemon=True)

    @property
    def tokens_per_second(self) -> float:
        """Output tokens relayed over the last RATE_WINDOW seconds, all requests together."""
        now = time.monotonic()
        while self._relayed and self._relayed[0][0] < now - RATE_WINDOW:
            self._relayed.popleft()
        # Sum a snapshot: the worker thread appends while the event loop reads.
        return sum(n for _, n in list(self._relayed)) / RATE_WINDOW

    def _relay(self, job: Job, event: object) -> None:
        """Hand an output event or Done to its request, read into answer parts, counting
        its tokens. Every worker relays here, with the job's model resident."""
        if isinstance(event, OUTPUT_EVENTS):
            self._relayed.append((time.monotonic(), len(event.tokens)))
        if isinstance(event, (*OUTPUT_EVENTS, Done)):
            if job.reader is None:
                job.reader = AnswerReader(self._model.engine.tokenizer, job.generation.prompt)
            job.post(job.reader.read(event))

    @property
    def active(self) -> int:
        """Requests generating now."""
        return int(self.busy)

    def in_flight(self) -> list[Job]:
        """Requests the generation thread has taken from the queue and not ended."""
        return [self._running] if self._running is not None else []

    @property
    def waiting(self) -> int:
        """Queued requests whose clients still wait (one that left is skipped when its
        turn comes)."""
        return len(self._queued())

    def resident_engine(self, name: str) -> Engine | None:
        """The engine of `name` when it is the model in memory, for the event loop's own
        use of its tokenizer (counting a prompt's tokens); None when it is not."""
        model = self._model
        return model.engine if model is not None and self.resident == name else None

    def start(self) -> None:
        self.thread.start()

    def shutdown(self, grace: float = 0.0) -> None:
        """Refuse new requests and end the queued ones now; the running ones may finish
        within `grace` seconds, then end with a 503 that says why. Returns at once; a
        second call (no grace) ends the running ones now."""
        if not self._stopping.is_set():
            self._stopping.set()
            for job in drain(self._waiting):
                self._refuse(job)
            self._waiting.put(None)
            if grace > 0:
                timer = threading.Timer(grace, self._cut)
                timer.daemon = True
                timer.start()
                return
        self._cut()

    def _cut(self) -> None:
        """The server stops now: every running request ends, told why."""
        for job in self.in_flight():
            job.post(self.why_stopping())
            job.cancel()

    def _refuse(self, job: Job) -> None:
        job.post(self.why_stopping())
        job.end()

    def why_stopping(self) -> ApiError:
        """What a request refused or cut by the stop hears."""
        return shutting_down()

    def stop(self, timeout: float = 30.0) -> None:
        """Shut down and wait for the thread to end."""
        self.shutdown()
        self.thread.join(timeout)

    @property
    def queue_room(self) -> int:
        """Requests the queue may hold now, where `max_waiting` caps it: that many
        behind the one running."""
        return self.max_waiting

    def _queued(self) -> list[Job]:
        """The requests waiting whose clients are still there (one that left is skipped
        when its turn comes, and holds nobody up)."""
        return [job for job in list(self._waiting.queue) if job is not None and not job.cancelled]

    def _ahead(self, position: int | None = None) -> int:
        """Requests that must end before the one `position` places down the queue starts
        (None: one queued now, at its end): those queued before it and the one running."""
        position = len(self._queued()) if position is None else position
        return position + int(self.busy)

    def ahead_of(self, job: Job) -> int | None:
        """Requests that must end before `job` starts, while it waits in the queue; None
        once the generation thread has taken it (what a waiting stream's comments say)."""
        queued = self._queued()
        return self._ahead(queued.index(job)) if job in queued else None

    def check_fits(self, generation: Generation) -> None:
        """ApiError (400) where the resident model already says the request cannot run
        (its prompt is past the context, a token id out of range), so that a stream about
        to wait its turn is refused with a status instead of an event after its headers.
        Only what the tokenizer and the settings tell: no MLX work, so it may run on any
        thread; another model's request is checked when it opens."""
        model = self._model
        if model is None or self.resident != generation.model:
            return
        try:
            model.engine.check_request(generation.prompt, generation.settings, None)
        except GenerationError as err:
            raise refused(err) from None

    def expected_wait(self) -> float | None:
        """Seconds a request queued now would wait to start (None: not known yet)."""
        return self.drain.expected_wait(self._ahead())

    def submit(self, generation: Generation) -> Job:
        """Queue a request (called on the event loop only, so the check cannot race):
        refused (429, with Retry-After) only where the explicit cap is reached, where the
        wait it would face is over `max_queue_wait`, or where the prompts waiting would
        pass MAX_QUEUED_BYTES."""
        if self._stopping.is_set():
            raise self.why_stopping()
        queued = self._queued()
        waiting = len(queued)
        wait = self.expected_wait()
        retry = RETRY_AFTER_SECONDS if wait is None else retry_after(wait, self.max_queue_wait)
        if self.max_waiting is not None and waiting >= self.queue_room:
            raise queue_full(f"{waiting} requests are already waiting for the model", retry)
        if wait is not None and wait > self.max_queue_wait:
            raise queue_full(
                f"{waiting} requests are waiting, about {wait:.0f} s of work at the pace the "
                f"model keeps (this server refuses waits over {self.max_queue_wait:.0f} s)",
                retry,
            )
        job = Job(generation, asyncio.get_running_loop(), self.drain.ended)
        held = sum(job.size for job in queued)
        if held + job.size > MAX_QUEUED_BYTES:
            raise queue_full(f"the {waiting} requests waiting hold {held >> 20} MiB", retry)
        self._waiting.put(job)
        return job

    def _serve(self) -> None:
        self._open_preload()
        while (job := self._waiting.get()) is not None:
            if self._stopping.is_set():
                self._refuse(job)
                continue
            if not job.cancelled:
                self._running, self.busy = job, True
                self._run(job)
                self._running, self.busy = None, False
            job.end()
        self._release_streams()

    def _open_preload(self) -> None:
        if self.preload is not None:
            try:
                self._open(self.preload)
            except ApiError as err:
                log.error("%s", err.message)

    def _save_prompts(self) -> None:
        """The resident model's prompt caches to disk, so that a restart starts warm; a
        full or read-only disk costs a warning, never a request."""
        if self._model is not None:
            try:
                self._model.engine.save_prompts()
            except Exception:
                log.exception("could not save the prompt caches")

    def _release_streams(self) -> None:
        # MLX 0.32 can abort the process at exit when a thread that ran generations
        # ends with its streams alive (seen in the chat app); release them here.
        self._save_prompts()
        self._model = None
        gc.collect()
        mx.clear_streams()

    def _run(self, job: Job) -> None:
        request = job.generation
        try:
            model = self._open(request.model)
            proposer = _prepare_proposer(model, request.proposer)
            _check_token_ids(request.prompt, model.engine.vocab_size)
            job.generation = constrained(request, model.engine.tokenizer)
            events = self._stream(model, job, proposer)
            try:
                for event in events:
                    if job.cancelled and self.stops_between_events:
                        break
                    self._relay(job, event)
            finally:
                events.close()  # a cancelled run stops here, between two rounds
        except ApiError as err:
            job.post(err)
        except GenerationError as err:
            job.post(refused(err))
        except Exception as err:
            job.post(self._failure(err))

    # Whether `_run` may stop a cancelled request at any event (a sharded stream stops
    # itself, after a round every rank has finished).
    stops_between_events = True

    def _stream(self, model: OpenModel, job: Job, proposer: str) -> Iterator[Event]:
        request = job.generation
        return model.engine.stream(request.prompt, request.settings, proposer)

    def _failure(self, err: Exception) -> ApiError:
        """What the client hears about an error nobody expected."""
        log.exception("generation failed")
        return _internal_error()

    def _open(self, name: str) -> OpenModel:
        if self.resident == name:
            return self._model
        # One model at a time: let the old weights go before loading the new ones.
        self._save_prompts()
        self._model, self.resident = None, None
        gc.collect()
        mx.clear_cache()
        try:
            self._model = self.provider.open(name)
        except Exception as err:  # a missing download, a broken file, no network...
            log.exception("cannot load %s", name)
            raise ApiError(
                503,
                f"cannot load model {name!r}: {err}",
                code="model_unavailable",
                type="server_error",
            ) from None
        self.resident = name
        return self._model


def queue_full(why: str, retry: int) -> ApiError:
    return ApiError(
        429,
        f"{why}; retry after {retry} s",
        code="queue_full",
        type="rate_limit_error",
        headers={"Retry-After": str(retry)},
    )


def prompt_bytes(prompt: object) -> int:
    """What a queued prompt holds: its text (a conversation's messages and tools, an
    infill's prefix, suffix and extra files)."""
    if isinstance(prompt, Infill):
        texts = [prompt.prefix, prompt.suffix, prompt.prompt, *(f.text for f in prompt.extra)]
        return sum(len(text) for text in texts)
    if isinstance(prompt, Conversation):
        return sum(len(str(message.get("content") or "")) for message in prompt.messages) + len(
            str(prompt.tools or "")
        )
    return len(prompt) * (1 if isinstance(prompt, str) else 8)


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down", code="shutting_down", type="server_error")


def drain(waiting: queue.Queue) -> list[Job]:
    """Every job still queued, taken off the queue."""
    jobs = []
    while True:
        try:
            job = waiting.get_nowait()
        except queue.Empty:
            return jobs
        if job is not None:
            jobs.append(job)


def _internal_error() -> ApiError:
    return ApiError(
        500,
        "generation failed; the server log has the details",
        code="internal_error",
        type="server_error",
    )


def _prepare_proposer(model: OpenModel, name: str | None) -> str:
    try:
        return model.proposer(name)
    except ValueError as err:  # unknown, or one this model cannot use (tokenizers differ)
        raise ApiError(400, str(err), code="invalid_proposer", param="mlxspec.proposer") from None
    except Exception as err:  # its weights are missing, or would not load
        log.exception("cannot prepare proposer %s", name)
        raise ApiError(
            503,
            str(err),
            code="proposer_unavailable",
            type="server_error",
            param="mlxspec.proposer",
        ) from None


def _check_token_ids(prompt: object, vocab_size: int) -> None:
    """Token ids past the vocabulary would index outside the embedding table."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        largest = max(prompt)
        if largest >= vocab_size:
            raise ApiError(
                400,
                f"prompt: token id {largest} is out of range; this model has {vocab_size} tokens",
                code="invalid_value",
                param="prompt",
            )
