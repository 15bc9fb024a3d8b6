"""Recent responses, kept in memory so a stateful client's next turn can name the last one
(`previous_response_id`) instead of sending the conversation again.

Bounded by count and by the bytes of the items kept (a 20k-token agent conversation is
about 80 KB of JSON); the least recently used response goes first. Nothing is written to
disk, and a request with `store: false` is not kept (Codex sends that and resends its
history itself).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

MAX_RESPONSES = 256
MAX_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class Stored:
    """A response as a later turn needs it: every item of its conversation so far (the
    earlier turns', its input, its output), and the response object itself for GET."""

    items: tuple[dict[str, Any], ...]
    response: dict[str, Any]
    size: int  # bytes of JSON, what the bound counts


class ResponseStore:
    def __init__(self, max_responses: int = MAX_RESPONSES, max_bytes: int = MAX_BYTES):
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self._kept: OrderedDict[str, Stored] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._kept)

    @property
    def bytes(self) -> int:
        return self._bytes

    def put(self, response: dict[str, Any], items: list[dict[str, Any]]) -> None:
        """Keep `response`, whose conversation is `items` (its output included)."""
        size = len(json.dumps(items)) + len(json.dumps(response))
        if size > self.max_bytes:
            return  # larger than the whole store: keeping it would empty the store for it
        with self._lock:
            old = self._kept.pop(response["id"], None)
            self._bytes -= old.size if old else 0
            self._kept[response["id"]] = Stored(tuple(items), response, size)
            self._bytes += size
            while len(self._kept) > self.max_responses or self._bytes > self.max_bytes:
                _, dropped = self._kept.popitem(last=False)
                self._bytes -= dropped.size

    def get(self, response_id: str) -> Stored | None:
        with self._lock:
            found = self._kept.get(response_id)
            if found is not None:
                self._kept.move_to_end(response_id)
            return found

    def delete(self, response_id: str) -> bool:
        with self._lock:
            found = self._kept.pop(response_id, None)
            self._bytes -= found.size if found else 0
            return found is not None
