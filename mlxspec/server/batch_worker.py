"""The generation thread with continuous batching: up to `max_batch` requests share
each target pass (`mlxspec.batch.Scheduler`).

Between rounds the thread takes queued requests into free slots, relays each request's
events to its own channel, and drops requests whose client went away (their slot is
free by the next round). A request the batch cannot serve (a model whose cache cannot
be batched, a proposer with state of its own, draft trees where the batch cannot
verify them) and a request for another model wait until the batch has drained, then
run alone as in `Worker`.
"""

from __future__ import annotations

import logging
import queue

from mlxspec.batch.memory import GB, kv_budget
from mlxspec.batch.rows import unbatchable_reason
from mlxspec.batch.scheduler import Scheduler
from mlxspec.batch.target import unsupported_reason
from mlxspec.batch.width import ROW_FLOOR
from mlxspec.decoding.engine import GenerationError
from mlxspec.events import Done
from mlxspec.server.errors import ApiError, refused
from mlxspec.server.providers import ModelProvider
from mlxspec.server.worker import (
    Job,
    Worker,
    _check_token_ids,
    _internal_error,
    _prepare_proposer,
    constrained,
)

log = logging.getLogger("mlxspec.server")


class BatchedWorker(Worker):
    def __init__(
        self,
        provider: ModelProvider,
        max_waiting: int | None,
        max_batch: int,
        preload: str | None = None,
        row_floor: float = ROW_FLOOR,
        kv_memory: float | None = None,
    ):
        """`kv_memory`: GB of KV the batch may hold (`serve --kv-memory`; None: a share
        of the device's memory, 0: no bound; `mlxspec.batch.memory`)."""
        super().__init__(provider, max_waiting, preload)
        self.max_batch, self.row_floor, self.kv_memory = max_batch, row_floor, kv_memory
        self._scheduler: Scheduler | None = None  # for the resident model, when it batches
        self._jobs: dict[int, Job] = {}  # request id in the scheduler -> its job
        self._held: Job | None = None  # waits for the batch to drain, then runs alone

    @property
    def active(self) -> int:
        """Requests generating now: the batch's (prefilling ones included), or the one
        running alone."""
        return self._rows() or int(self._running is not None)

    @property
    def queue_room(self) -> int:
        """`max_waiting`, plus the batch's free slots: a burst that arrives during a round
        sits in the queue until the round ends, and requests that will have a slot at
        once must not be refused for it. A model that cannot batch, or a request running
        alone, has no free slots: then the queue is `max_waiting`, as without batching."""
        return self.max_waiting + self._free_slots()

    def _free_slots(self) -> int:
        cannot_batch = self._model is not None and self._scheduler is None
        if cannot_batch or self._running is not None:
            return 0
        return max(0, self.max_batch - self._rows())

    def _ahead(self, position: int | None = None) -> int:
        """Requests that must end before the one `position` places down the queue starts
        (None: one queued now): those queued beyond the batch's free slots (with a slot
        free, none)."""
        position = len(self._queued()) if position is None else position
        beyond = position - self._free_slots()
        return beyond + 1 if beyond >= 0 and (self._rows() or self._running) else 0

    def ahead_of(self, job: Job) -> int | None:
        """As `Worker.ahead_of`; the request held to run alone waits for the batch's rows."""
        if job is self._held:
            return self._rows()
        return super().ahead_of(job)

    def in_flight(self) -> list[Job]:
        """The batch's requests, the one running alone, and the one waiting to."""
        held = [self._held] if self._held is not None else []
        return [*super().in_flight(), *held, *list(self._jobs.values())]

    def _open(self, name: str):
        """Let the old model's batch (its engine, rows and kept prefixes) go before the
        next model loads, as the one-at-a-time worker lets the old weights go."""
        if name != self.resident:
            self._scheduler = None
        return super()._open(name)

    def _rows(self) -> int:
        """Requests the scheduler holds: it, not the job table, says what still runs."""
        scheduler = self._scheduler
        if scheduler is None:
            return 0
        return len(scheduler.waiting) + len(scheduler.joining) + len(scheduler.active)

    def _serve(self) -> None:
        self._open_preload()
        if self._model is not None:  # measure the batch's costs before the first request
            try:
                self._scheduler_for(self._model.engine)
            except Exception:  # the thread must live on: the first request retries, and
                log.exception("cannot prepare the batch")  # fails alone with a 500
        stopping = False
        while not stopping or self._rows():
            if not stopping:
                stopping = self._admit()
            if self._rows():
                self._round()
            self.busy = self._rows() > 0
        if self._held is not None:  # stopped while it waited for the batch to drain
            self._refuse(self._held)
        self._release_streams()

    def _admit(self) -> bool:
        """Take queued requests into free slots (waiting for one when idle); True once
        the queue says stop."""
        while self._rows() < self.max_batch:
            if self._held is not None:
                if self._rows():
                    return False
                job, self._held = self._held, None
                self._alone(job)
                continue
            try:
                job = self._waiting.get(block=not self._rows())
            except queue.Empty:
                return False
            if job is None:
                return True
            if self._stopping.is_set():
                self._refuse(job)
                continue
            if job.cancelled:
                job.end()
                continue
            self._take(job)
        return False

    def _take(self, job: Job) -> None:
        request = job.generation
        if self.resident != request.model and self._rows():
            self._held = job
            return
        try:
            model = self._open(request.model)
            proposer = _prepare_proposer(model, request.proposer)
            _check_token_ids(request.prompt, model.engine.vocab_size)
            job.generation = request = constrained(request, model.engine.tokenizer)
            scheduler = self._scheduler_for(model.engine)
            if scheduler is None or _alone_reason(scheduler, proposer, request.settings):
                self._held = job
                return
            request_id = scheduler.submit(request.prompt, request.settings, proposer)
        except ApiError as err:
            job.post(err)
            job.end()
            return
        except GenerationError as err:
            job.post(refused(err))
            job.end()
            return
        except Exception:  # the thread must outlive any one request's failure
            log.exception("cannot start a request")
            job.post(_internal_error())
            job.end()
            return
        self._jobs[request_id] = job

    def _alone(self, job: Job) -> None:
        self._running, self.busy = job, True
        self._run(job)
        self._running, self.busy = None, False
        job.end()

    def _scheduler_for(self, engine) -> Scheduler | None:
        if self._scheduler is None or self._scheduler.engine is not engine:
            self._scheduler = None
            if unsupported_reason(engine.target.model) is None:
                if engine.kv.quantized:  # once per model the batch serves
                    log.warning(
                        "--kv-bits %d: the batch keeps float KV (mlx-lm has no quantized "
                        "batch cache); with --max-batch 1 every request holds it quantized",
                        engine.kv.bits,
                    )
                self._scheduler = Scheduler(
                    engine, self.max_batch, row_floor=self.row_floor, kv_budget=self._kv_budget()
                )
        return self._scheduler

    def _kv_budget(self) -> int | None:
        """Bytes of KV the batch may hold, with the model loaded (its weights count)."""
        budget = kv_budget(self.kv_memory)
        if budget == 0:  # the weights took the default's share: say why nothing batches
            log.warning(
                "no memory left for a batch's KV beside the weights: requests run one at a "
                "time (serve --kv-memory GB sets the budget)"
            )
        return budget

    @property
    def kv_memory_use(self) -> dict | None:
        """The batch's KV bound and what its rows and kept prefixes may come to hold, in
        GB (None while no batch runs)."""
        scheduler = self._scheduler
        if scheduler is None:
            return None
        budget = scheduler.kv_budget
        return {
            "budget_gb": None if budget is None else round(budget / GB, 2),
            "reserved_gb": round(scheduler.kv_reserved() / GB, 3),
        }

    def _round(self) -> None:
        scheduler = self._scheduler
        for request_id, job in list(self._jobs.items()):
            if job.cancelled:  # its client left, or the server stops (`Worker._cut`)
                scheduler.cancel(request_id)
                del self._jobs[request_id]
                job.end()
        try:
            out = scheduler.step()
        except Exception as err:
            self._fail_all(err)
            return
        for request_id, error in scheduler.failed.items():
            log.error("request %d failed: %r", request_id, error)
            if job := self._jobs.pop(request_id, None):
                job.post(_failure_heard(job, error))
                job.end()
        scheduler.failed.clear()
        for request_id, events in out.items():
            job = self._jobs.get(request_id)
            for event in events if job else ():
                self._relay(job, event)
                if isinstance(event, Done):
                    del self._jobs[request_id]
                    job.end()

    def _fail_all(self, err: Exception) -> None:
        """A round failed: end every request in it with an error and start afresh."""
        log.error("batched generation failed", exc_info=err)
        for job in self._jobs.values():
            job.post(_internal_error())
            job.end()
        self._jobs.clear()
        self._scheduler = None  # its rows went with it


def _failure_heard(job: Job, error: Exception) -> ApiError:
    """What the client hears of its request's failure in the batch: the engine's refusal
    (a grammar that did not compile, or not in time) is a 400, as when it runs alone,
    while nothing was answered yet; anything else is the server's."""
    if isinstance(error, GenerationError) and job.reader is None:
        return refused(error)
    return _internal_error()


def _alone_reason(scheduler: Scheduler, proposer: str, settings) -> str | None:
    """Why a request must run alone rather than in the batch (None: it can batch)."""
    if settings.tree and (reason := scheduler.caches.tree_unsupported):
        return reason
    found = scheduler.engine.proposers.get(proposer)
    cannot = scheduler.caches.capture_unsupported
    return unbatchable_reason(found, cannot) if found is not None else None
