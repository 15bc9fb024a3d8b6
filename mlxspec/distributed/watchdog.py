"""A deadline on every collective wait: MLX's collectives block in C++ and cannot be
interrupted, so a stuck peer would hang this rank forever. A thread ends the process
with one clear line when the rank has not made progress within `timeout` seconds."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable


class Watchdog:
    def __init__(self, timeout: float, rank: int):
        self.timeout, self.rank = timeout, rank
        # What a timeout does instead of ending the process at once (the server on rank 0
        # first answers its clients); it must end the process itself.
        self.on_timeout: Callable[[str], None] | None = None
        self._deadline: float | None = None
        self._what = ""
        self._lock = threading.Lock()
        thread = threading.Thread(target=self._watch, name="mlxspec-watchdog", daemon=True)
        thread.start()

    def arm(self, what: str) -> None:
        """Progress was made; the next must come within the timeout."""
        with self._lock:
            self._deadline, self._what = time.monotonic() + self.timeout, what

    def disarm(self) -> None:
        """Waiting is legitimate now (e.g. for the user's next request)."""
        with self._lock:
            self._deadline = None

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout / 4))
            with self._lock:
                late = self._deadline is not None and time.monotonic() > self._deadline
                what = self._what
            if late:
                reason = (
                    f"no progress from the other ranks for {self.timeout:g} s "
                    f"while {what} (a rank or the network is stuck)"
                )
                if self.on_timeout is not None:
                    self.on_timeout(reason)
                    return
                who = "" if self.rank == 0 else f"rank {self.rank}: "
                sys.stderr.write(f"Error: {who}{reason}; stopping\n")
                sys.stderr.flush()
                os._exit(1)
