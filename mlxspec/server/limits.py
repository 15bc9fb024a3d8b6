"""What one server allows: body size, tokens, queue, batch and KV memory."""

from __future__ import annotations

from dataclasses import dataclass

from mlxspec.batch.width import ROW_FLOOR


@dataclass(frozen=True)
class ServerLimits:
    max_body_bytes: int = 1 << 20
    max_tokens: int = 4096  # per request; longer prompts are bounded by the model's context
    # A cap on queued requests (None: none; more get 429). Without one the queue is bounded
    # by the wait it would impose and the memory its prompts hold (queue_wait.py).
    max_waiting: int | None = None
    max_queue_wait: float = 300.0  # seconds a request may expect to wait in line
    max_batch: int = 1  # requests generating together (continuous batching when > 1)
    # The least share of its plain speed a request keeps while others' drafts widen the
    # shared pass (mlxspec.batch.width.choose_width).
    row_floor: float = ROW_FLOOR
    # GB of KV a batch may hold (None: a share of the device's memory; 0: no bound).
    kv_memory: float | None = None
