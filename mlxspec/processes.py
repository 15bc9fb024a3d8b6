"""Every process mlxspec starts has one owner: the process the user started.

The owner ends what it started on every way out: a stop signal (SIGINT, SIGTERM,
SIGHUP: `stop_signals` turns each into a call, not a sudden death), a crash (a `finally`)
and a normal exit. SIGKILL reaches no handler, so every started process also watches its
own parent (`exit_with_parent`) and ends when it is gone; polling the parent pid works
the same on Linux and macOS, and on a remote host as well (the parent there is ssh's).
A started process that starts others (mlx.launch) passes that watch on to them.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

PARENT_ENV = "MLXSPEC_PARENT_PID"  # the pid a started process must see as its parent
POLL_SECONDS = 0.5  # how often a started process checks that its parent is still there
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a process this one starts and owns: it learns who its parent is
    (so that a parent gone before it even looked is noticed too)."""
    return {**(os.environ if env is None else env), PARENT_ENV: str(os.getpid())}


def exit_with_parent(on_orphaned: Callable[[], None] | None = None) -> None:
    """In a started process: once the process that started it is gone, call
    `on_orphaned` (by default: one line and exit 1) on a thread of its own, which runs
    even while the main thread waits in a collective."""
    expected = int(os.environ.pop(PARENT_ENV, "0") or 0) or os.getppid()

    def watch() -> None:
        while os.getppid() == expected:
            time.sleep(POLL_SECONDS)
        (on_orphaned or _exit_orphaned)()

    threading.Thread(target=watch, name="mlxspec-parent", daemon=True).start()


def _exit_orphaned() -> None:
    try:
        sys.stderr.write("Error: the process that started this one is gone; stopping\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # its stderr went with it
        pass
    os._exit(1)


def owned_python(module: str) -> list[str]:
    """The command line that runs `python -m MODULE` (then its arguments) as a process
    that ends with this one, SIGKILL included (start it with `child_env()`)."""
    run = f"import runpy; runpy.run_module({module!r}, run_name='__main__', alter_sys=True)"
    watch = "from mlxspec.processes import exit_with_parent; exit_with_parent()"
    return [sys.executable, "-c", f"{watch}; {run}"]


def become_launcher() -> None:
    """In mlx.launch's process (see distributed.launch): its ranks watch it as their
    parent, and it ends its whole process group (its ranks, and itself) once its own
    owner is gone."""
    exit_with_parent(lambda: os.killpg(0, signal.SIGTERM))
    os.environ[PARENT_ENV] = str(os.getpid())


@contextmanager
def stop_signals(on_stop: Callable[[int], None]) -> Iterator[None]:
    """Within the block, SIGINT, SIGTERM and SIGHUP call `on_stop(signum)` instead of
    ending the process at once (the main thread only: elsewhere nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {signum: signal.signal(signum, lambda s, _: on_stop(s)) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


def group_running(pgid: int) -> bool:
    """Whether any process of the group still runs."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def end_group(pgid: int, seconds: float) -> None:
    """Make sure nothing of a process group this process started runs on: SIGTERM, and
    SIGKILL for what is still there after `seconds`."""
    if not group_running(pgid):
        return
    signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + seconds
    while group_running(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    signal_group(pgid, signal.SIGKILL)


def stop_reason(signum: int) -> str:
    """What the user reads about a stop signal (Ctrl-C is an interruption)."""
    if signum == signal.SIGINT:
        return "interrupted"
    return f"stopped by {signal.Signals(signum).name}"
