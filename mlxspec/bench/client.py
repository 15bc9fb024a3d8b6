"""One streamed chat request against the API, timed the way a client feels it.

Standard library only (http.client): the bench must run where the server runs, and the
server's own dependencies do not include an HTTP client.
"""

from __future__ import annotations

import http.client
import json
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit


class RequestFailed(RuntimeError):
    """The server answered with an error (status and its message)."""


@dataclass
class Answer:
    prompt_id: str
    text: str
    sent: float  # perf_counter when the request went out
    first: float | None  # when the first piece of text arrived
    done: float  # when the stream ended
    record: dict[str, Any] = field(default_factory=dict)  # x_mlxspec: the run record

    @property
    def tokens(self) -> int:
        return int(self.record.get("completion_tokens", 0))

    @property
    def latency(self) -> float:
        return self.done - self.sent

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first is None else self.first - self.sent

    @property
    def per_token(self) -> float | None:
        """Seconds between tokens after the first: the pace a reader sees."""
        if self.first is None or self.tokens < 2:
            return None
        return (self.done - self.first) / (self.tokens - 1)


def stream_chat(base_url: str, prompt_id: str, body: dict[str, Any], timeout: float) -> Answer:
    """POST `body` to /v1/chat/completions with `stream` on; the timed answer."""
    where = urlsplit(base_url)
    connection = http.client.HTTPConnection(where.hostname, where.port, timeout=timeout)
    payload = json.dumps({**body, "stream": True})
    try:
        sent = time.perf_counter()
        connection.request(
            "POST", "/v1/chat/completions", payload, {"Content-Type": "application/json"}
        )
        response = connection.getresponse()
        if response.status != 200:
            raise RequestFailed(f"{response.status}: {_message(response.read())}")
        pieces, first, record = [], None, {}
        for raw in response:
            line = raw.decode("utf-8").strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                raise RequestFailed(chunk["error"].get("message", "error"))
            for choice in chunk.get("choices", ()):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    first = first or time.perf_counter()
                    pieces.append(piece)
            record = chunk.get("x_mlxspec") or record
        return Answer(prompt_id, "".join(pieces), sent, first, time.perf_counter(), record)
    finally:
        connection.close()


def _message(body: bytes) -> str:
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body.decode("utf-8", "replace")[:200]
