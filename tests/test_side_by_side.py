"""The suite's two workers: an `alone` test runs with the other worker paused, and waits
for no more than the test already running (tests/side_by_side.py)."""

from __future__ import annotations

import threading
import time

from side_by_side import Turns, turn


def enter(folder, alone: bool, log: list, name: str, hold: float) -> threading.Thread:
    def run():
        with turn(folder, alone):
            log.append(f"{name} in")
            time.sleep(hold)
            log.append(f"{name} out")

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_an_alone_test_waits_for_the_running_one_and_holds_off_the_next(tmp_path):
    """`beside` is running; `alone` arrives and waits for it; `next`, arriving while
    `alone` waits, starts only after `alone` is done (the gate), not beside it."""
    log: list[str] = []
    beside = enter(tmp_path, False, log, "beside", 0.3)
    time.sleep(0.1)
    alone = enter(tmp_path, True, log, "alone", 0.3)
    time.sleep(0.1)
    after = enter(tmp_path, False, log, "next", 0.0)
    for thread in (beside, alone, after):
        thread.join(5)
    assert log == ["beside in", "beside out", "alone in", "alone out", "next in", "next out"]


def test_tests_that_are_not_alone_run_side_by_side(tmp_path):
    log: list[str] = []
    first = enter(tmp_path, False, log, "a", 0.3)
    time.sleep(0.1)
    second = enter(tmp_path, False, log, "b", 0.0)
    for thread in (first, second):
        thread.join(5)
    assert log == ["a in", "b in", "b out", "a out"]


def test_consecutive_alone_tests_keep_the_machine_between_them(tmp_path):
    """A worker with two `alone` tests in a row holds the machine from the first to the
    end of the second: the other worker's test, arriving during the first, runs after
    both (let in between, it would have made the second wait for it)."""
    log: list[str] = []
    turns = Turns(tmp_path)

    def two_alone():
        for name, next_alone in (("first", True), ("second", False)):
            with turns.test(True, next_alone):
                log.append(f"{name} in")
                time.sleep(0.3)
                log.append(f"{name} out")
            time.sleep(0.1)  # the worker between tests: reports, the next setup

    worker = threading.Thread(target=two_alone)
    worker.start()
    time.sleep(0.1)
    other = enter(tmp_path, False, log, "other", 0.0)
    for thread in (worker, other):
        thread.join(5)
    assert log == ["first in", "first out", "second in", "second out", "other in", "other out"]
