"""The suite ends, whatever a test does: `pytest -x` after a failing `alone` test, a test
that waits behind a long `alone` one, a test that hangs. Each check runs a small pytest of
its own on two workers with this suite's `side_by_side` plugin, as the suite runs."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

# A failing `alone` test followed by another `alone` one (the worker keeps the machine
# between them), and beside it a file whose tests wait for their turn meanwhile.
FAILING_ALONE = """
import time
import pytest
pytestmark = pytest.mark.alone

def test_fails_holding_the_machine():
    time.sleep(1.5)
    assert False, "deliberate"

def test_would_have_kept_it():
    pass
"""
WAITING_BESIDE = """
import time
import pytest

@pytest.mark.parametrize("i", range(30))
def test_beside(i):
    time.sleep(0.3)
"""
# An `alone` test longer than the per-test limit, and beside it tests that must wait for it.
LONG_ALONE = """
import time
import pytest

@pytest.mark.alone
def test_long_alone():
    time.sleep(4)
"""
SHORT_BESIDE = """
import time

def test_short_1():
    time.sleep(0.5)

def test_short_2():
    time.sleep(0.5)

def test_short_3():
    time.sleep(0.5)
"""
HANGING = """
import threading
import time

def test_hangs():
    threading.Thread(target=time.sleep, args=(60,), name="a-helper-thread", daemon=True).start()
    time.sleep(60)
"""


def run_pytest(folder: Path, *args: str, limit: float) -> tuple[subprocess.CompletedProcess, float]:
    """pytest on `folder`'s files, two workers by file as the suite runs, within `limit` s."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
    }
    command = [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile"]
    command += ["-p", "side_by_side", "-p", "no:cacheprovider", "--rootdir", str(folder), *args]
    started = time.monotonic()
    try:
        done = subprocess.run(
            command, cwd=folder, env=env, capture_output=True, text=True, timeout=limit
        )
    except subprocess.TimeoutExpired as expired:
        out = (expired.stdout or b"").decode(errors="replace")[-2000:]
        pytest.fail(f"pytest {' '.join(args)} did not end within {limit} s:\n{out}")
    return done, time.monotonic() - started


def write(folder: Path, **files: str) -> Path:
    for name, text in files.items():
        (folder / f"{name}.py").write_text(text)
    return folder


def test_pytest_x_ends_after_a_failing_alone_test_with_a_worker_waiting_beside_it(tmp_path):
    """The failing worker used to keep both locks (its next test was `alone` too) and go
    idle, while the other one waited for the lock forever, deaf to the stop."""
    folder = write(tmp_path, test_a=FAILING_ALONE, test_b=WAITING_BESIDE)
    done, seconds = run_pytest(folder, "-x", limit=60)
    assert done.returncode != 0, done.stdout[-2000:]  # 2: xdist reports the stop as interrupted
    assert "1 failed" in done.stdout and "deliberate" in done.stdout, done.stdout[-2000:]
    # what the other worker still had queued is skipped, not run to its end
    assert "skipped" in done.stdout, done.stdout[-2000:]
    assert seconds < 30, f"-x took {seconds:.0f} s to end"


def test_a_test_waiting_for_its_turn_is_not_timed_out_for_the_wait(tmp_path):
    """pytest-timeout's limit is on the test, not on its wait behind an `alone` one (the
    turn's hook wraps the timeout's)."""
    folder = write(tmp_path, test_a=LONG_ALONE, test_b=SHORT_BESIDE)
    done, _ = run_pytest(folder, "--timeout", "3", "-o", "timeout_method=signal", limit=60)
    # the alone test itself outlives its limit; the three beside it wait, then pass
    assert "1 failed, 3 passed" in done.stdout, done.stdout[-3000:]
    assert "test_long_alone" in done.stdout and "Timeout" in done.stdout


def test_a_hanging_test_fails_at_its_limit_with_every_threads_stack(tmp_path):
    folder = write(tmp_path, test_hangs=HANGING)
    done, seconds = run_pytest(folder, "--timeout", "2", "-o", "timeout_method=signal", limit=60)
    assert done.returncode == 1 and "1 failed" in done.stdout, done.stdout[-3000:]
    assert "Timeout" in done.stdout and "a-helper-thread" in done.stdout, done.stdout[-3000:]
    assert seconds < 30


def test_this_suite_runs_under_a_time_limit(pytestconfig):
    """Every test of the suite has a limit (pyproject's `timeout`), signalled, so a hang
    fails one test with a stack dump instead of holding the run."""
    assert float(pytestconfig.getini("timeout")) > 0
    assert pytestconfig.getini("timeout_method") == "signal"
