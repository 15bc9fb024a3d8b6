"""Two pytest-xdist workers share this 2-core machine; a test marked `alone` runs with the
other worker paused.

Most of the suite is short in-process tests that leave a core idle while MLX waits on
memory, so two workers finish it sooner. Some tests cannot share the machine: a timing
held to a ratio (the run record's estimate against the bench), a bound in seconds (a
stuck rank found within 30 s), the adaptive policy deciding whether a draft pays on
SmolLM2, and the sharded runs, whose two or three rank processes already fill both cores
(side by side they slow each other's collectives past their timeouts). Those are marked
`alone` (`pytestmark` for a whole module).

A readers-writer lock over the workers, two `flock`s in the run's own temporary dir: a
test holds `running` shared, an `alone` test holds it exclusive. The `gate` makes it fair:
an `alone` test takes the gate first, so the other worker, between tests, waits at the gate
instead of starting test after test while the `alone` one waits for a gap. Without
pytest-xdist (`-p no:xdist`, `-n 0`) nothing is locked.

OpenBLAS starts a thread per core in each worker, and its idle threads spin: four threads
on two cores. Beside the other worker a test gets one BLAS thread, in this process and in
the commands it starts (OPENBLAS_NUM_THREADS); an `alone` test gets every core, as a user's
run does. Two files side by side ran 10 % faster so (test_lossless and
test_sampling_settings: 136 and 140 s against 122 and 127 s). A thread count the user set
is left as it is.

The run must end whatever happens to a worker. A worker whose run stops (a failure under
`-x`/`--maxfail`, an interrupt) lets the machine go at once, even between two `alone` tests,
and leaves a `stop` note in the lock dir; a worker waiting for its turn polls the locks, so
it sees the note instead of waiting on a worker that will never run again, and from then on
skips what pytest-xdist still hands it (its queue is not cleared by the stop). A worker
that dies lets go too (the kernel drops a dead process's flocks). The wait for a turn stays
outside pytest-timeout's limit on each test (this hook runs first), so a test waiting behind
a long `alone` chain is not timed out for waiting; the wait has a bound of its own,
WAIT_LIMIT.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from mlxspec import blas

ALONE = "alone"
THREADS = "OPENBLAS_NUM_THREADS"
STOP = "stop"  # the lock dir's note that a worker's run stopped (-x, --maxfail, interrupt)
POLL_SECONDS = 0.05
# The longest a test waits for its turn: longer than any `alone` chain of this suite runs
# quietly here (test_distributed.py's, about 6 minutes).
WAIT_LIMIT = 30 * 60


class RunStopping(Exception):
    """Another worker's run stopped while this one waited for its turn."""


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        f"{ALONE}: runs while the other pytest-xdist worker waits (timings, sharded runs)",
    )


def _lock_dir() -> Path | None:
    """The run's lock dir, shared by its workers; None outside a pytest-xdist worker."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not os.environ.get("PYTEST_XDIST_WORKER") or not run:
        return None
    folder = Path(tempfile.gettempdir()) / f"mlxspec-tests-{run}"
    folder.mkdir(exist_ok=True)
    return folder


def _take(handle, mode: int) -> None:
    """flock, polled: a waiting worker still sees the stop note (and an interrupt), and a
    wait past WAIT_LIMIT fails instead of hanging the run."""
    stop = Path(handle.name).with_name(STOP)
    deadline = time.monotonic() + WAIT_LIMIT
    while True:
        try:
            fcntl.flock(handle, mode | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        if stop.exists():
            raise RunStopping(stop.read_text())
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {WAIT_LIMIT} s for {handle.name}: the other worker hung")
        time.sleep(POLL_SECONDS)


@contextmanager
def _held(path: Path, mode: int):
    with open(path, "a+") as handle:
        _take(handle, mode)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextmanager
def turn(folder: Path, alone: bool):
    """Hold the machine for one test: alone, or beside the other worker's tests."""
    gate, running = folder / "gate", folder / "running"
    if alone:
        with _held(gate, fcntl.LOCK_EX), _held(running, fcntl.LOCK_EX):
            yield
        return
    with open(running, "a+") as handle:
        with _held(gate, fcntl.LOCK_SH):  # waits while an `alone` test holds or awaits it
            _take(handle, fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class Turns:
    """One worker's turns. Consecutive `alone` tests keep the machine between them: let
    in between, the other worker started a test that the next `alone` one then waited
    for, a core idle meanwhile (111 s of waits over the suite's 66 `alone` tests)."""

    def __init__(self, folder: Path):
        self.folder, self._kept = folder, None

    @contextmanager
    def test(self, alone: bool, next_alone: bool):
        if not alone:
            with turn(self.folder, False):
                yield
            return
        if self._kept is None:
            self._kept = ExitStack()
            self._kept.enter_context(turn(self.folder, True))
        try:
            yield
        finally:
            if not next_alone:
                self.release()

    def release(self) -> None:
        """Let the machine go (a kept `alone` turn): the next test will not come."""
        if self._kept is not None:
            self._kept.close()
            self._kept = None


_TURNS: dict[Path, Turns] = {}


def _stopping(session) -> str:
    return str(session.shouldfail or session.shouldstop or "")


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """Setup, call and teardown inside the turn: a module's server or model starts in its
    first test's setup and stops in its last one's teardown. First of the wrappers, so the
    wait for the turn is outside pytest-timeout's limit on the test."""
    folder = _lock_dir()
    if folder is None:
        yield
        return
    turns = _TURNS.setdefault(folder, Turns(folder))
    alone = item.get_closest_marker(ALONE) is not None
    next_alone = nextitem is not None and nextitem.get_closest_marker(ALONE) is not None
    try:
        if (folder / STOP).exists():  # the controller still hands out this worker's queue
            raise RunStopping((folder / STOP).read_text())
        with turns.test(alone, next_alone), blas_share(alone):
            yield
    except RunStopping as stopped:  # raised before the yield: the test runs as a skip
        item.add_marker(pytest.mark.skip(reason=f"the run is stopping: {stopped}"))
        yield
    finally:
        if _stopping(item.session):
            stop_the_run(folder, turns, _stopping(item.session))


def stop_the_run(folder: Path, turns: Turns, why: str) -> None:
    """This worker runs no more tests: let the machine go, and tell a waiting worker."""
    turns.release()
    (folder / STOP).write_text(why)


def pytest_sessionfinish(session):
    """However the worker's loop ended (-x, an interrupt, its last test), nothing is kept."""
    folder = _lock_dir()
    if folder is not None and folder in _TURNS:
        if _stopping(session):
            stop_the_run(folder, _TURNS[folder], _stopping(session))
        _TURNS[folder].release()


_USERS_THREADS = os.environ.get(THREADS)


@contextmanager
def blas_share(alone: bool):
    """One OpenBLAS thread beside the other worker, every core alone (unless the user
    chose a count): for this process's BLAS and the commands the test starts."""
    if _USERS_THREADS is not None:
        yield
        return
    if alone:
        os.environ.pop(THREADS, None)
        blas.set_threads(blas.cores())
    else:
        os.environ[THREADS] = "1"
        blas.set_threads(1)
    yield
