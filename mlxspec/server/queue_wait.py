"""How long a request joining the queue would wait, from how fast the queue drains.

A queue bounded by a small count refused a crowd long before memory or patience ran out
(64 clients, 8 slots: 40 refused). What a client can live with is a wait, so the queue is
bounded by the wait it would impose (`serve --max-queue-wait`) and by the memory its
prompts hold, and a refusal says when to come back (`Retry-After`) from the same rate.
The rate is measured, not assumed: requests ended per second over the last few, counted
up to now, so a queue that has stopped draining reads as slow.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque

WINDOW = 32  # the last requests' ends the rate is measured over
# The prompts queued requests hold (their text, before it is tokenized and prefilled):
# beyond this a request is refused whatever the wait.
MAX_QUEUED_BYTES = 256 << 20


class DrainRate:
    """Requests ended per second, measured; `expected_wait` for a place in line."""

    def __init__(self, window: int = WINDOW, clock=time.monotonic):
        self._ends: deque[float] = deque(maxlen=window)
        self._clock = clock
        self._lock = threading.Lock()

    def ended(self) -> None:
        """A request left the server (answered, failed or cancelled): worker thread."""
        with self._lock:
            self._ends.append(self._clock())

    def per_second(self) -> float | None:
        """None until two requests have ended: nothing is known of the pace yet."""
        with self._lock:
            ends = list(self._ends)
        if len(ends) < 2:
            return None
        span = self._clock() - ends[0]
        return (len(ends) - 1) / span if span > 0 else None

    def expected_wait(self, ahead: int) -> float | None:
        """Seconds until a request with `ahead` requests before it in line starts (0 with
        none ahead); None while the pace is unknown."""
        if ahead <= 0:
            return 0.0
        rate = self.per_second()
        return None if rate is None else ahead / rate


def retry_after(wait: float, bound: float) -> int:
    """Whole seconds after which the queue will have drained below `bound` of wait."""
    return max(1, math.ceil(wait - bound))
