"""OpenAI's response and stream-chunk shapes, for chat and text completions.

Chat puts the answer's text in `message.content` / `delta.content`, its reasoning in
`reasoning_content` and its calls in `tool_calls` (a streamed call: its id and name first,
then its arguments' text); text completions put the text in `choices[0].text`.
Everything else is shared: the id/created/model envelope, `usage`, and `x_mlxspec`,
the run record (on the response, or on the stream's finishing chunk). With provenance
asked for, each streamed piece of text says who wrote it: "accepted" for draft tokens
the target agreed with, "target" for the target's own tokens (a piece held back for a
possible marker is credited to the event that released it).

Asked for, logprobs cover every emitted token: chat's `logprobs.content` holds the
reasoning's tokens and the tool calls' markup too, so the entries join up to the whole
output that `usage.completion_tokens` counts. vLLM's chat server does the same (its
logprobs run over all the output's token ids, whatever its reasoning and tool parsers made
of them), and so does mlx-lm's (every generated token, unstreamed; it streams none).
Streamed, an entry rides on the first chunk that carries its token's text, so a token the
parser holds back as a possible marker's start waits with its text; markup the parser
drops gets a chunk with the entries alone.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from mlxspec.events import Accepted, Event, RunRecord
from mlxspec.logprobs import TokenLogprob
from mlxspec.markup.conversation import (
    AnswerPart,
    AnswerText,
    ParsedAnswer,
    ReasoningText,
    ToolCallArguments,
    ToolCallStarted,
)
from mlxspec.server.openai.logprobs import rendered_logprobs


def usage(record: RunRecord) -> dict:
    return {
        "prompt_tokens": record.prompt_tokens,
        "completion_tokens": record.completion_tokens,
        "total_tokens": record.prompt_tokens + record.completion_tokens,
        # OpenAI's own field: the prompt tokens a kept cache already held (prompt cache)
        "prompt_tokens_details": {"cached_tokens": record.reused_prompt_tokens},
        "completion_tokens_details": {"reasoning_tokens": record.reasoning_tokens},
    }


def finish_reason(record: RunRecord, answer: ParsedAnswer) -> str:
    return "tool_calls" if answer.tool_calls else record.finish_reason


def _delta(part: AnswerPart) -> dict:
    """A chat stream's delta for one part of the answer."""
    if isinstance(part, ReasoningText):
        return {"reasoning_content": part.text}
    if isinstance(part, AnswerText):
        return {"content": part.text}
    if isinstance(part, ToolCallStarted):
        function = {"name": part.name, "arguments": ""}
        call = {"index": part.index, "id": part.id, "type": "function", "function": function}
        return {"tool_calls": [call]}
    assert isinstance(part, ToolCallArguments)
    return {"tool_calls": [{"index": part.index, "function": {"arguments": part.text}}]}


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
    echo: str = ""  # a text completion's prompt, given back before it (`echo`)
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
        self,
        record: RunRecord,
        text: str,
        answer: ParsedAnswer,
        logprobs: tuple[TokenLogprob, ...] | None,
    ) -> dict:
        """The whole answer, for a request without `stream` (`text`: all of it, for a text
        completion; `answer`: its parts, for chat; `logprobs`: every emitted token's
        entry, where asked for)."""
        if self.chat:
            # OpenAI's shape: an answer that only called tools has no content, not "".
            content = None if answer.tool_calls and not answer.text else answer.text
            choice = self._choice(content, finish_reason(record, answer), streamed=False)
            message = choice["message"]
            if answer.reasoning:
                message["reasoning_content"] = answer.reasoning
            if answer.tool_calls:
                message["tool_calls"] = [
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                    for call in answer.tool_calls
                ]
        else:
            choice = self._choice(self.echo + text, record.finish_reason, streamed=False)
        choice["logprobs"] = rendered_logprobs(logprobs, self.chat)
        return {
            **self._envelope(streamed=False),
            "choices": [choice],
            "usage": usage(record),
            "x_mlxspec": record.to_dict(),
        }

    def opening_chunk(self) -> dict | None:
        """Chat streams announce the assistant's role before any text; an echoed text
        completion starts with its prompt."""
        if not self.chat:
            if not self.echo:
                return None
            return {
                **self._envelope(streamed=True),
                "choices": [self._choice(self.echo, None, True)],
            }
        chunk = {**self._envelope(streamed=True), "choices": [self._choice("", None, True)]}
        chunk["choices"][0]["delta"]["role"] = "assistant"
        return chunk

    def output_chunks(
        self,
        parts: tuple[AnswerPart, ...],
        event: Event | None,
        with_provenance: bool,
        logprobs: tuple[TokenLogprob, ...] | None,
    ) -> list[dict]:
        """The chunks of what one output let go of: its parts, the logprob entries riding
        on the first; the entries alone where it released no part (markup, or the whitespace
        after it, that the parser dropped)."""
        if not parts:
            return [self._logprobs_chunk(logprobs)] if logprobs else []
        return [
            self._part_chunk(part, event, with_provenance, None if index else logprobs)
            for index, part in enumerate(parts)
        ]

    def _logprobs_chunk(self, logprobs: tuple[TokenLogprob, ...]) -> dict:
        choice = self._choice(None, None, streamed=True)
        choice["logprobs"] = rendered_logprobs(logprobs, self.chat)
        return {**self._envelope(streamed=True), "choices": [choice]}

    def _part_chunk(
        self,
        part: AnswerPart,
        event: Event | None,
        with_provenance: bool,
        logprobs: tuple[TokenLogprob, ...] | None,
    ) -> dict:
        """One part of the answer; `event`: the output event that released it (None: the
        end of the answer did)."""
        if self.chat:
            choice = {"index": 0, "delta": _delta(part), "logprobs": None, "finish_reason": None}
        else:
            choice = self._choice(part.text, None, streamed=True)
        choice["logprobs"] = rendered_logprobs(logprobs, self.chat)
        if with_provenance and isinstance(part, AnswerText):
            where = choice["delta"] if self.chat else choice
            where["x_mlxspec"] = {"provenance": provenance(event) if event else "target"}
        return {**self._envelope(streamed=True), "choices": [choice]}

    def finishing_chunk(self, record: RunRecord, answer: ParsedAnswer) -> dict:
        choice = self._choice(None, finish_reason(record, answer), streamed=True)
        return {**self._envelope(streamed=True), "choices": [choice], "x_mlxspec": record.to_dict()}

    def usage_chunk(self, record: RunRecord) -> dict:
        """Sent last when the client asked for `stream_options.include_usage`."""
        return {**self._envelope(streamed=True), "choices": [], "usage": usage(record)}
