"""OpenAI's response and stream-chunk shapes, for chat and text completions.

Chat puts text in `message` / `delta.content`; text completions in `choices[0].text`.
Everything else is shared: the id/created/model envelope, `usage`, and `x_mlxspec`,
the run record (on the response, or on the stream's finishing chunk). With provenance
asked for, each streamed piece of text says who wrote it: "accepted" for draft tokens
the target agreed with, "target" for the target's own tokens.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from mlxspec.events import Accepted, Event, RunRecord
from mlxspec.logprobs import TokenLogprob
from mlxspec.server.logprobs import rendered_logprobs


def usage(record: RunRecord) -> dict:
    return {
        "prompt_tokens": record.prompt_tokens,
        "completion_tokens": record.completion_tokens,
        "total_tokens": record.prompt_tokens + record.completion_tokens,
    }


def provenance(event: Event) -> str:
    return "accepted" if isinstance(event, Accepted) else "target"


def sse(payload: dict | str) -> str:
    """One server-sent event; ASCII JSON, so any text survives the wire."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


@dataclass(frozen=True)
class Reply:
    """One response: its envelope, and the shapes of its body or stream chunks."""

    chat: bool
    model: str
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))

    def _envelope(self, streamed: bool) -> dict:
        prefix, kind = ("chatcmpl", "chat.completion") if self.chat else ("cmpl", "text_completion")
        kind += ".chunk" if streamed and self.chat else ""
        return {
            "id": f"{prefix}-{self.id}",
            "object": kind,
            "created": self.created,
            "model": self.model,
        }

    def _choice(self, text: str | None, finish_reason: str | None, streamed: bool) -> dict:
        if not self.chat:
            return {
                "index": 0,
                "text": text or "",
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        if streamed:
            body = {} if text is None else {"content": text}
            return {"index": 0, "delta": body, "logprobs": None, "finish_reason": finish_reason}
        message = {"role": "assistant", "content": text}
        return {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}

    def complete(
        self, record: RunRecord, text: str, logprobs: tuple[TokenLogprob, ...] | None = None
    ) -> dict:
        """The whole answer, for a request without `stream`."""
        choice = self._choice(text, record.finish_reason, streamed=False)
        choice["logprobs"] = rendered_logprobs(logprobs, self.chat)
        return {
            **self._envelope(streamed=False),
            "choices": [choice],
            "usage": usage(record),
            "x_mlxspec": record.to_dict(),
        }

    def opening_chunk(self) -> dict | None:
        """Chat streams announce the assistant's role before any text."""
        if not self.chat:
            return None
        chunk = {**self._envelope(streamed=True), "choices": [self._choice("", None, True)]}
        chunk["choices"][0]["delta"]["role"] = "assistant"
        return chunk

    def text_chunk(self, event: Event, with_provenance: bool) -> dict:
        choice = self._choice(event.text, None, streamed=True)
        choice["logprobs"] = rendered_logprobs(event.logprobs, self.chat)
        if with_provenance:
            where = choice["delta"] if self.chat else choice
            where["x_mlxspec"] = {"provenance": provenance(event)}
        return {**self._envelope(streamed=True), "choices": [choice]}

    def finishing_chunk(self, record: RunRecord) -> dict:
        choice = self._choice(None, record.finish_reason, streamed=True)
        return {**self._envelope(streamed=True), "choices": [choice], "x_mlxspec": record.to_dict()}

    def usage_chunk(self, record: RunRecord) -> dict:
        """Sent last when the client asked for `stream_options.include_usage`."""
        return {**self._envelope(streamed=True), "choices": [], "usage": usage(record)}
