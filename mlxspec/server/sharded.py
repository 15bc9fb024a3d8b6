"""`serve --ranks/--hostfile` on rank 0: the generation thread announces every request to
the other ranks (they `follow` it, see distributed.rank) and stops a request whose client
left only after a round every rank has finished. With `--max-batch` above 1 it runs the
batch, whose cache work every rank replays (distributed.batch); a request the batch
cannot take runs alone, announced as above.

A lost rank cannot be worked around: MLX's collectives block in C++ and cannot be
interrupted, and the model is split. So the failure path answers every client first (a
503 naming the rank, while the event loop is still free), then ends the process, non-zero.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator

from mlxspec.batch.scheduler import Scheduler
from mlxspec.batch.width import ROW_FLOOR
from mlxspec.distributed.batch import PlannedCaches, batches
from mlxspec.distributed.errors import DistributedError
from mlxspec.distributed.rank import RankSession, report_exit
from mlxspec.events import Done, Event
from mlxspec.registry.models_toml import ModelEntry
from mlxspec.server.batch_worker import BatchedWorker
from mlxspec.server.errors import ApiError
from mlxspec.server.providers import ModelInfo, ModelProvider, OpenModel
from mlxspec.server.worker import Job, Worker, drain

log = logging.getLogger("mlxspec.server")

GRACE_SECONDS = 1.5  # for the 503s to reach the clients before the process ends
STOP_SECONDS = 5.0  # a stop (Ctrl-C) that has not ended the process by then ends it


class RankProvider:
    """The one model every rank loads at start, sharded. A sharded server does not switch
    models: every rank would have to reload in step, and each host holds one shard."""

    def __init__(self, entry: ModelEntry, session: RankSession, notify: Callable[[str], None]):
        self.entry, self.session, self.notify = entry, session, notify
        self.default = entry.name
        self.models = {
            entry.name: ModelInfo(
                entry.name, tuple(entry.proposer_names), entry.defaults, entry.description
            )
        }

    def check(self, name: str, proposer: str | None) -> None:
        """Nothing to download: the model was loaded (or failed) at start."""

    def open(self, name: str) -> OpenModel:
        return self.session.open_runtime(self.entry, self.notify, follows=True)


class ShardedWorker(Worker):
    stops_between_events = False  # rank 0 alone must not stop mid-round

    def __init__(
        self, provider: ModelProvider, max_waiting: int, session: RankSession, preload: str
    ):
        super().__init__(provider, max_waiting, preload)
        self._attach(session)

    def _attach(self, session: RankSession) -> None:
        self.session = session
        self.failure: ApiError | None = None
        self._fail_lock = threading.Lock()
        session.watchdog.on_timeout = self.fail

    def _stream(self, model: OpenModel, job: Job, proposer: str) -> Iterator[Event]:
        request = job.generation
        stop = lambda: job.cancelled  # noqa: E731  (read by rank 0 after every round)
        return self.session.stream(model, request.prompt, request.settings, proposer, stop)

    def _open_preload(self) -> None:
        try:  # every rank loads now, in step; one that cannot leaves nothing to serve
            self._open(self.preload)
        except ApiError as err:
            self.fail(err.message)

    def _failure(self, err: Exception) -> ApiError:
        if isinstance(err, (DistributedError, RuntimeError)):  # a collective failed
            log.error("%s", err)
            return self.fail(_first_line(err))
        return super()._failure(err)

    def _release_streams(self) -> None:
        """A clean stop leads the other ranks out (they return, exit 0): a collective, so
        before this thread lets its MLX streams go."""
        if self.failure is None:
            try:
                self.session.end_following()
            except RuntimeError as err:  # a rank is gone after all
                self.fail(_first_line(err))
        super()._release_streams()

    def shutdown(self, grace: float = 0.0) -> None:
        """A stop signal, or mlx.launch stopping this rank: a rank that already ended is
        why, and the requests hear so; otherwise stop as one process does (the other ranks
        follow to the end), or end the process if that has not happened in time."""
        if self._stopping.is_set():  # the ranks may have been led out already: no check
            super().shutdown(grace)
            return
        if self.session.gone_ranks():
            self.fail("stopped by the launcher")
            return
        super().shutdown(grace)
        timer = threading.Timer(grace + STOP_SECONDS, self.fail, ("the server was stopped",))
        timer.daemon = True
        timer.start()

    def why_stopping(self) -> ApiError:
        """A request that arrives after a rank was lost hears which rank, as those
        that were running did: "shutting down" alone would not tell it why."""
        return self.failure or super().why_stopping()

    def fail(self, reason: str) -> ApiError:
        """A rank is lost: every running and queued request ends with a 503 naming it,
        new ones are refused, and the process ends non-zero once the answers are out."""
        with self._fail_lock:
            if self.failure is not None:
                return self.failure
            gone = self.session.gone_ranks()
            who = ", ".join(map(str, gone))
            if gone:
                reason = (
                    f"rank {who} ended while serving"
                    if len(gone) == 1
                    else (f"ranks {who} ended while serving")
                )
            message = f"{reason}; the sharded model cannot go on and the server is stopping"
            self.failure = ApiError(503, message, code="rank_failed", type="server_error")
            self._stopping.set()
            jobs = [*self.in_flight(), *drain(self._waiting)]
            self._waiting.put(None)  # the generation thread, if it is free, ends
        for job in filter(None, jobs):
            job.post(self.failure)
        _say_error(message)
        threading.Thread(target=_exit_after_grace, name="mlxspec-exit", daemon=True).start()
        return self.failure


class ShardedBatchedWorker(ShardedWorker, BatchedWorker):
    """`serve --ranks N --max-batch B`: the batch on rank 0, one sharded pass a round for
    all its rows. The failure path, the requests that run alone and the end of following
    are `ShardedWorker`'s; the batch is `BatchedWorker`'s, with caches the other ranks
    replay."""

    def __init__(
        self,
        provider: ModelProvider,
        max_waiting: int,
        session: RankSession,
        preload: str,
        max_batch: int,
        row_floor: float = ROW_FLOOR,
        kv_memory: float | None = None,
    ):
        BatchedWorker.__init__(
            self, provider, max_waiting, max_batch, preload, row_floor, kv_memory
        )
        self._attach(session)

    def _scheduler_for(self, engine) -> Scheduler | None:
        """One batch for the one model a sharded server holds; the other ranks decide
        the same way whether there is one (`batches`), and calibrate with it."""
        if self._scheduler is None and batches(engine.target.model, self.max_batch):
            caches = PlannedCaches(engine.target.model, self.max_batch, self.session.collectives)
            self._scheduler = Scheduler(
                engine, self.max_batch, caches, self.row_floor, self._kv_budget()
            )
            # Its calibration's collectives leave the watchdog armed; waiting for the first
            # request is legitimate however long (else an idle server stops itself).
            self.session.watchdog.disarm()
        return self._scheduler

    def _fail_all(self, err: Exception) -> None:
        """A round that failed half-way leaves the ranks' caches apart (or a rank is
        gone): nothing can go on, so every request hears why and the server stops."""
        log.error("batched generation failed", exc_info=err)
        self.fail(_first_line(err))
        self._jobs.clear()
        self._scheduler = None

    def _relay(self, job: Job, event: object) -> None:
        if isinstance(event, Done):
            self.session.describe(event.record)
        super()._relay(job, event)


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _say_error(message: str) -> None:
    try:
        sys.stderr.write(f"Error: {message}\n")
        sys.stderr.flush()
    except OSError:  # the launcher is gone already
        pass


def _exit_after_grace() -> None:
    threading.Event().wait(GRACE_SECONDS)
    try:
        report_exit(1)
    except OSError:
        pass
    os._exit(1)
