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
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from mlxspec import blas

ALONE = "alone"
THREADS = "OPENBLAS_NUM_THREADS"


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


@contextmanager
def _held(path: Path, mode: int):
    with open(path, "a+") as handle:
        fcntl.flock(handle, mode)
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
            fcntl.flock(handle, fcntl.LOCK_SH)
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
                self._kept.close()
                self._kept = None


_TURNS: dict[Path, Turns] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Setup, call and teardown inside the turn: a module's server or model starts in its
    first test's setup and stops in its last one's teardown."""
    folder = _lock_dir()
    if folder is None:
        yield
        return
    turns = _TURNS.setdefault(folder, Turns(folder))
    alone = item.get_closest_marker(ALONE) is not None
    next_alone = nextitem is not None and nextitem.get_closest_marker(ALONE) is not None
    with turns.test(alone, next_alone), blas_share(alone):
        yield


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
