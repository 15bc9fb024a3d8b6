"""An answer in Ollama's shapes: one JSON object per line (NDJSON) while it streams, the
last with `done: true`, why it ended and its counts (durations in nanoseconds); the same
last object, holding the whole answer, when it does not stream. `/api/chat` puts the text
in `message` (with `thinking` and `tool_calls`, whose arguments are objects), `/api/generate`
in `response` (and `thinking`).

Lines are compact JSON, as Go writes them: clients split the body on newlines and parse each
line (the `ollama` packages, Continue, Zed), so an object must never span two.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from mlxspec.events import RunRecord
from mlxspec.markup.conversation import AnswerPart, AnswerText, ParsedAnswer, ReasoningText
from mlxspec.server.errors import ApiError
from mlxspec.server.ollama.model_facts import timestamp

NDJSON = "application/x-ndjson"
NS = 1_000_000_000


def line(body: dict[str, Any]) -> str:
    """One NDJSON line."""
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")) + "\n"


def error_body(err: ApiError) -> dict[str, Any]:
    """Ollama's error shape: `{"error": "..."}`, whatever the status."""
    return {"error": err.message}


def tool_calls(answer: ParsedAnswer) -> list[dict[str, Any]]:
    """The answer's calls, arguments as objects (Ollama's clients read them so)."""
    return [
        {
            "id": call.id,
            "function": {"index": index, "name": call.name, "arguments": _object(call.arguments)},
        }
        for index, call in enumerate(answer.tool_calls)
    ]


@dataclass
class Reply:
    """One answer's lines; `chat`: /api/chat's `message`, else /api/generate's `response`."""

    model: str
    chat: bool
    started: float = field(default_factory=time.perf_counter)

    def part(self, part: AnswerPart) -> dict[str, Any] | None:
        """A streamed part's line (tool calls come whole, at the end: `closing`)."""
        if isinstance(part, ReasoningText):
            return self._line(self._said("", part.text), done=False)
        if isinstance(part, AnswerText):
            return self._line(self._said(part.text, None), done=False)
        return None

    def closing(self, answer: ParsedAnswer, record: RunRecord) -> list[dict[str, Any]]:
        """A stream's last lines: the calls made, if any, then the counts."""
        lines = []
        if answer.tool_calls and self.chat:
            lines.append(self._line(self._said("", None, tool_calls(answer)), done=False))
        lines.append(self._final(self._said("", None), record))
        return lines

    def whole(self, answer: ParsedAnswer, record: RunRecord) -> dict[str, Any]:
        """The answer in one object (`stream: false`)."""
        said = self._said(answer.text, answer.reasoning or None, tool_calls(answer))
        return self._final(said, record)

    def loaded(self) -> dict[str, Any]:
        """What an empty request answers once the model is in memory."""
        body = self._line(self._said("", None), done=True)
        return {**body, "done_reason": "load"}

    def _said(
        self, text: str, thinking: str | None, calls: list[dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        if not self.chat:
            return {"response": text, **({"thinking": thinking} if thinking else {})}
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if thinking:
            message["thinking"] = thinking
        if calls:
            message["tool_calls"] = calls
        return {"message": message}

    def _line(self, said: dict[str, Any], done: bool) -> dict[str, Any]:
        return {
            "model": self.model,
            "created_at": timestamp(datetime.now(UTC)),
            **said,
            "done": done,
        }

    def _final(self, said: dict[str, Any], record: RunRecord) -> dict[str, Any]:
        total = time.perf_counter() - self.started
        prompt_seconds = record.prefill_seconds
        return {
            **self._line(said, done=True),
            "done_reason": "length" if record.finish_reason == "length" else "stop",
            "total_duration": _ns(total),
            "load_duration": 0,  # a load is in the queue's wait, not measured apart
            "prompt_eval_count": record.prompt_tokens,
            "prompt_eval_duration": _ns(prompt_seconds),
            "eval_count": record.completion_tokens,
            "eval_duration": _ns(
                max(record.time_to_first_token - prompt_seconds, 0.0) + record.decode_seconds
            ),
            "x_mlxspec": record.to_dict(),
        }


def _ns(seconds: float) -> int:
    return int(seconds * NS)


def _object(arguments: str) -> dict[str, Any]:
    """A call's arguments as generated (the parser hands on only JSON objects)."""
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return parsed if isinstance(parsed, dict) else {}
