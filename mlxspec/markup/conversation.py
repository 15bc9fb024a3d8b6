"""The one request shape inside, and the parts an answer comes out in.

Every API dialect (OpenAI chat, OpenAI completions, Anthropic messages) and the chat TUI
translate into a `Conversation` on the way in and out of `AnswerPart`s on the way out, so
tools, tool results and reasoning are built once, below the dialects.

A `Conversation`'s messages are in the form Hugging Face chat templates expect: a dict with
`role` ("system", "user", "assistant" or "tool") and `content` (a string); an assistant turn
may carry `tool_calls` ([{"id", "type": "function", "function": {"name", "arguments"}}] with
`arguments` a dict, as templates iterate over it), a tool turn `tool_call_id` and `name`.
Tools are in OpenAI's function form: {"type": "function", "function": {"name",
"description", "parameters"}}.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Conversation:
    """Messages, the tools the model may call, and the chat template's extra arguments
    (`chat_template_kwargs`, e.g. {"enable_thinking": False})."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ToolCall:
    """A call the model made: `arguments` is the JSON text of an object, as generated."""

    id: str
    name: str
    arguments: str


# The parts of an answer, as streamed deltas. Concatenating the text of every ReasoningText
# gives the reasoning, of every AnswerText the answer; a tool call is announced by
# ToolCallStarted and its arguments' JSON text follows in ToolCallArguments pieces.


@dataclass(frozen=True)
class ReasoningText:
    text: str


@dataclass(frozen=True)
class AnswerText:
    text: str


@dataclass(frozen=True)
class ToolCallStarted:
    index: int  # 0, 1, ... in the order the calls were made
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArguments:
    index: int
    text: str


AnswerPart = ReasoningText | AnswerText | ToolCallStarted | ToolCallArguments


@dataclass(frozen=True)
class ParsedAnswer:
    """A whole answer split into its parts."""

    reasoning: str
    text: str
    tool_calls: tuple[ToolCall, ...] = ()
