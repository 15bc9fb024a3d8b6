"""The few small collectives mlxspec adds on top of the model's own, each timed.

All go through mx.distributed (no transport of our own). MLX has no broadcast, so
rank 0's value is sent as an all_sum where the other ranks contribute zeros.
"""

from __future__ import annotations

import json
import time
from typing import Any

import mlx.core as mx
import numpy as np

from mlxspec.distributed.bell import Bell
from mlxspec.distributed.watchdog import Watchdog


class Collectives:
    def __init__(self, group: mx.distributed.Group, watchdog: Watchdog):
        self.group, self.watchdog = group, watchdog
        self.rank, self.size = group.rank(), group.size()
        self.seconds = 0.0  # time spent waiting in these collectives
        self.calls = 0
        self.bell: Bell | None = None  # serve and chat: rank 0 rings before announcing

    def _run(self, array: mx.array, what: str, op, idle: bool = False) -> np.ndarray:
        """`idle`: waiting here is legitimate however long (for the user's next request),
        so no deadline until the value arrives."""
        self._deadline(what, idle)
        start = time.perf_counter()
        result = op(array, group=self.group, stream=mx.cpu)
        mx.eval(result)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        self.watchdog.arm(what)
        return np.array(result)

    def all_gather(self, values: list[int], what: str) -> np.ndarray:
        """Every rank's `values` (same length everywhere), one row per rank."""
        rows = self._run(mx.array(values, dtype=mx.int32), what, mx.distributed.all_gather)
        return rows.reshape(self.size, len(values))

    def broadcast_ints(self, values: list[int], what: str, idle: bool = False) -> list[int]:
        """Rank 0's `values` on every rank (the others pass any list of the same length)."""
        mine = values if self.rank == 0 else [0] * len(values)
        summed = self._run(mx.array(mine, dtype=mx.int32), what, mx.distributed.all_sum, idle)
        return [int(v) for v in summed]

    def broadcast_json(self, value: Any, what: str, idle: bool = False) -> Any:
        """Rank 0's JSON-able `value` on every rank (the others pass None). `idle`: the
        other ranks may wait for it without a deadline (the payload, once announced, has one)."""
        data = json.dumps(value).encode() if self.rank == 0 else b""
        (length,) = self.broadcast_ints([len(data)], what, idle)
        payload = list(data) if self.rank == 0 else [0] * length
        return json.loads(bytes(self.broadcast_ints(payload, what)).decode())

    def announce(self, value: Any, what: str) -> Any:
        """Rank 0: `broadcast_json` of what the ranks in `RankSession.follow` wait for,
        rung first so that they wait asleep (`bell`); the other ranks' side of the same
        broadcast (a generate's `agree`) passes None."""
        if self.bell is not None and self.rank == 0:
            self.bell.ring()
        return self.broadcast_json(value, what)

    def await_announcement(self, what: str, idle: bool) -> Any:
        """A following rank: rank 0's next `announce`, waited for asleep where there is a
        bell. `idle`: however long (between requests), else within the watchdog's time."""
        if self.bell is not None:
            self._deadline(what, idle)
            self.bell.wait()
        return self.broadcast_json(None, what, idle)

    def _deadline(self, what: str, idle: bool) -> None:
        """The watchdog for a wait: none while `idle`, else the timeout from now."""
        if idle:
            self.watchdog.disarm()
        else:
            self.watchdog.arm(what)

    def allreduce_latency(self, width: int, repeats: int = 20) -> float:
        """Median seconds of one all_sum of a `width`-float vector: the model's own
        collective (one hidden state per token), measured outside the model."""
        vector = mx.ones((1, width), dtype=mx.float32)
        samples = []
        for i in range(repeats + 3):
            self.watchdog.arm("measuring all-reduce latency")
            start = time.perf_counter()
            mx.eval(mx.distributed.all_sum(vector, group=self.group, stream=mx.cpu))
            if i >= 3:
                samples.append(time.perf_counter() - start)
        return sorted(samples)[len(samples) // 2]
