"""Anthropic's Messages API, translated: a request into a `Conversation` and the fields
the server's settings read; an answer's parts into a message, or into its stream of
events; an error into Anthropic's shape.

Translation only: anthropic_routes.py runs the generation as the OpenAI routes do. Every
function here is pure, so each translation is tested on its own.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from mlxspec.events import RunRecord
from mlxspec.markup.conversation import (
    AnswerPart,
    AnswerText,
    Conversation,
    ParsedAnswer,
    ReasoningText,
    ToolCallArguments,
    ToolCallStarted,
)
from mlxspec.server.errors import ApiError, ContextExceeded
from mlxspec.server.request_body import (
    Count,
    GenerationRequest,
    JsonSchemaFormat,
    Lenient,
    MlxspecOptions,
    ResponseFormat,
    check_forced_schemas,
    effort_kwargs,
)
from mlxspec.structured.answer import AnswerConstraint
from mlxspec.structured.forced_tools import ForcedTools
from mlxspec.structured.grammar import Grammar

# --- The request ------------------------------------------------------------------------


class _Strict(Lenient):
    """Fields of Anthropic's API that mlxspec does not use (cache_control, citations,
    service_tier, Claude Code's context_management...) are ignored so that stock clients
    work, and logged at debug level."""


class TextBlock(_Strict):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: Annotated[str, Field(min_length=1)]
    name: Annotated[str, Field(min_length=1)]
    input: dict[str, Any]


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool | None = None  # the template has no place for it: the content says it


class ThinkingBlock(_Strict):
    type: Literal["thinking"]
    thinking: str
    signature: str = ""


class RedactedThinkingBlock(_Strict):
    type: Literal["redacted_thinking"]  # encrypted by Anthropic: nothing a template can show


class UnsupportedBlock(_Strict):
    type: Literal["image", "document"]  # accepted here, refused with a reason (`_refuse`)


Block = Annotated[
    TextBlock
    | ToolUseBlock
    | ToolResultBlock
    | ThinkingBlock
    | RedactedThinkingBlock
    | UnsupportedBlock,
    Field(discriminator="type"),
]


class MessageParam(_Strict):
    # "system": Claude Code sends its environment as a system turn among the messages; it
    # joins the system prompt, in order (templates take one, first).
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class Tool(_Strict):
    # Anthropic's server tools (web_search_20250305...) run nowhere here: dropped (`_tools`)
    type: str | None = None
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    # Anthropic's tool search loads such a tool when asked for it; here nothing can, so the
    # model is not shown it (Claude Code's DeferredToolPlaceholder)
    defer_loading: bool | None = None

    @property
    def runs_here(self) -> bool:
        return self.type in (None, "custom") and not self.defer_loading


class OutputFormat(_Strict):
    """`output_config.format`: Anthropic's structured output, the answer as JSON valid
    against `schema` (its only kind)."""

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")

    def grammar(self) -> Grammar:
        """The schema as a grammar; ApiError (400) naming what cannot be enforced."""
        json_format = JsonSchemaFormat(name="output", schema=self.schema_)
        return ResponseFormat(type="json_schema", json_schema=json_format).grammar(
            "output_config.format.schema"
        )


class OutputConfig(_Strict):
    effort: Literal["low", "medium", "high", "max"] | None = None
    format: OutputFormat | None = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(_Strict):
    type: Literal["enabled", "disabled", "adaptive"]  # adaptive: as the template has it
    budget_tokens: Annotated[int, Field(ge=1)] | None = None  # not enforced: no budget yet


class CountTokensRequest(_Strict):
    """What `/v1/messages/count_tokens` takes: the conversation part of a request."""

    model: str
    messages: Annotated[list[MessageParam], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None


class MessagesRequest(CountTokensRequest):
    """A `/v1/messages` request body."""

    max_tokens: Count
    stop_sequences: Annotated[list[str], Field(max_length=16)] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: Count | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None  # ignored
    mlxspec: MlxspecOptions = Field(default_factory=MlxspecOptions)


def conversation(body: CountTokensRequest, template_defaults: dict[str, Any]) -> Conversation:
    """The request as Hugging Face chat-template messages, tools and template arguments
    (`template_defaults`, the model's, yield to the request's `thinking`); ApiError (400)
    for what cannot be translated."""
    messages: list[dict[str, Any]] = []
    system = [_text(body.system)] if body.system else []
    tool_names: dict[str, str] = {}  # tool_use id -> the tool's name, as calls are made
    for position, message in enumerate(body.messages):
        where = f"messages[{position}]"
        if message.role == "system":
            system.append(_system_text(message.content, where))
        elif isinstance(message.content, str):
            messages.append({"role": message.role, "content": message.content})
        elif message.role == "assistant":
            messages.append(_assistant_turn(message.content, where, tool_names))
        else:
            messages.extend(_user_turns(message.content, where, tool_names))
    if system:
        messages.insert(0, {"role": "system", "content": "\n\n".join(system)})
    effort = body.output_config.effort if body.output_config else None
    template_kwargs = effort_kwargs(effort, template_defaults)
    if body.thinking is not None and body.thinking.type != "adaptive":
        template_kwargs["enable_thinking"] = body.thinking.type == "enabled"
    return Conversation(messages, _tools(body), template_kwargs)


def _system_text(content: str | list[Block], where: str) -> str:
    if isinstance(content, str):
        return content
    for index, block in enumerate(content):
        if not isinstance(block, TextBlock):
            raise _refuse(block, f"{where}.content[{index}]", "cannot be in a system turn")
    return _text(content)


def generation_request(body: MessagesRequest, max_tokens_limit: int) -> GenerationRequest:
    """The fields the server's settings read, in the shape the OpenAI routes give them
    (top_k, which OpenAI lacks, is passed on its own). Built without validating again:
    Anthropic's limits (temperature up to 1, stop sequences) were checked on `body`.

    `max_tokens` is clamped to the server's `max_tokens_limit`, not refused as OpenAI's
    is: Anthropic's clients must send it and send large ones (Claude Code asks for
    32000), so a refusal would stop them all. The run record's `max_tokens` says what
    was granted, and `stop_reason` "max_tokens" where the answer reached it."""
    return GenerationRequest.model_construct(
        model=body.model,
        max_tokens=min(body.max_tokens, max_tokens_limit),
        temperature=body.temperature,
        top_p=body.top_p,
        stop=body.stop_sequences,
        stream=body.stream,
        mlxspec=body.mlxspec,
    )


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "\n".join(block.text for block in content)


def _refuse(block: BaseModel, where: str, why: str) -> ApiError:
    return ApiError(400, f"{where}: {block.type} blocks {why}", code="invalid_value", param=where)


def _assistant_turn(blocks: list[Block], where: str, tool_names: dict[str, str]) -> dict:
    """One assistant message: its text, its reasoning (for templates that show earlier
    reasoning as `reasoning_content`; others ignore it) and its tool calls."""
    texts, reasoning, calls = [], [], []
    for index, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ThinkingBlock):
            reasoning.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            tool_names[block.id] = block.name
            function = {"name": block.name, "arguments": block.input}
            calls.append({"id": block.id, "type": "function", "function": function})
        elif isinstance(block, UnsupportedBlock):
            raise _refuse(block, f"{where}.content[{index}]", "are not supported by this server")
        elif isinstance(block, ToolResultBlock):
            raise _refuse(block, f"{where}.content[{index}]", "belong in a user turn")
    turn: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if reasoning:
        turn["reasoning_content"] = "\n".join(reasoning)
    if calls:
        turn["tool_calls"] = calls
    return turn


def _user_turns(blocks: list[Block], where: str, tool_names: dict[str, str]) -> list[dict]:
    """A tool message per tool result (Anthropic puts them first in a user turn), then
    the user's text, if any."""
    turns, texts = [], []
    for index, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolResultBlock):
            name = tool_names.get(block.tool_use_id)
            if name is None:
                raise ApiError(
                    400,
                    f"{where}.content[{index}].tool_use_id: {block.tool_use_id!r} answers no "
                    "earlier tool_use block",
                    code="invalid_value",
                    param=f"{where}.content[{index}].tool_use_id",
                )
            turns.append(
                {
                    "role": "tool",
                    "tool_call_id": block.tool_use_id,
                    "name": name,
                    "content": _text(block.content),
                }
            )
        elif isinstance(block, UnsupportedBlock):
            raise _refuse(block, f"{where}.content[{index}]", "are not supported by this server")
        elif not isinstance(block, RedactedThinkingBlock):
            raise _refuse(block, f"{where}.content[{index}]", "belong in an assistant turn")
    if texts:
        turns.append({"role": "user", "content": "\n".join(texts)})
    return turns


def _tools(body: CountTokensRequest) -> list[dict] | None:
    """The tools in OpenAI's function form, or None where the model must not see them."""
    choice = body.tool_choice.type if body.tool_choice else "auto"
    offered = [tool for tool in body.tools or () if tool.runs_here]
    if choice == "none" or not offered:
        return None
    return [
        {
            "type": "function",
            "function": {
                "name": tool.name,
                "description": tool.description or "",
                "parameters": tool.input_schema or {"type": "object"},
            },
        }
        for tool in offered
    ]


def dropped_tools(body: CountTokensRequest) -> list[str]:
    """The tools a request named that the model is not shown: server tools, deferred ones."""
    return [tool.name for tool in body.tools or () if not tool.runs_here]


def answer_constraint(body: CountTokensRequest) -> AnswerConstraint | None:
    """The forced tool calls of `tool_choice` ("any": a call to any tool; "tool": to the
    one it names), or the JSON of `output_config.format`, or None; ApiError (400) for a
    choice the tools cannot meet or a schema that cannot be enforced."""
    choice = body.tool_choice
    output_format = body.output_config.format if body.output_config else None
    if choice is None or choice.type not in ("any", "tool"):
        if output_format is None:
            return None
        return AnswerConstraint(grammar=output_format.grammar(), param="output_config.format")
    if output_format is not None:
        raise ApiError(
            400,
            "output_config.format: a forced tool_choice already sets the answer's form; "
            "drop one of them",
            code="invalid_value",
            param="output_config.format",
        )
    known = [tool.name for tool in body.tools or () if tool.runs_here]
    names = tuple(known) if choice.type == "any" else (choice.name or "",)
    if not names or not set(names) <= set(known):
        what = f"no tool named {names[0]!r} is in tools" if names else "tools are empty"
        raise ApiError(400, f"tool_choice: {what}", code="invalid_value", param="tool_choice")
    check_forced_schemas(
        [
            (f"tools[{index}].input_schema", tool.input_schema)
            for index, tool in enumerate(body.tools or ())
            if tool.runs_here and tool.name in names
        ]
    )
    forced = ForcedTools(names, parallel=not choice.disable_parallel_tool_use)
    return AnswerConstraint(tools=forced, param="tool_choice")


# --- The answer -------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    """Anthropic-style ids: msg_... for a message, toolu_... for a tool call."""
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def stop_reason(record: RunRecord, called_tools: bool) -> str:
    if record.finish_reason == "length":
        return "max_tokens"
    if record.stop_string is not None:
        return "stop_sequence"
    return "tool_use" if called_tools else "end_turn"


def usage(record: RunRecord) -> dict:
    """Anthropic's split: `input_tokens` are those prefilled now, and the prompt cache's
    share is `cache_read_input_tokens` (their sum is the prompt, as clients add them)."""
    reused = record.reused_prompt_tokens
    return {
        "input_tokens": record.prompt_tokens - reused,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": reused,
        "output_tokens": record.completion_tokens,
    }


def message(message_id: str, model: str, answer: ParsedAnswer, record: RunRecord) -> dict:
    """The whole answer, for a request without `stream`; `x_mlxspec` is the run record."""
    content: list[dict] = []
    if answer.reasoning:
        content.append({"type": "thinking", "thinking": answer.reasoning, "signature": ""})
    if answer.text:
        content.append({"type": "text", "text": answer.text})
    for call in answer.tool_calls:
        arguments = _tool_input(call.arguments)
        block = {"type": "tool_use", "id": new_id("toolu"), "name": call.name, "input": arguments}
        content.append(block)
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason(record, bool(answer.tool_calls)),
        "stop_sequence": record.stop_string,
        "usage": usage(record),
        "x_mlxspec": record.to_dict(),
    }


def _tool_input(arguments: str) -> dict:
    """A call's arguments as the object Anthropic's `input` is. Text that is not a JSON
    object (a model's malformed call) is kept whole under "_arguments", not lost."""
    try:
        parsed = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        parsed = None
    return parsed if isinstance(parsed, dict) else {"_arguments": arguments}


def event(name: str, payload: dict) -> str:
    """One server-sent event as Anthropic streams them: its type on an `event:` line."""
    return f"event: {name}\ndata: {json.dumps(payload)}\n\n"


BLOCK_OF = {ReasoningText: "thinking", AnswerText: "text"}
DELTA_OF = {"thinking": "thinking_delta", "text": "text_delta"}


@dataclass
class MessageStream:
    """One streamed answer's events: each part becomes a delta of the content block of
    its kind, a block opening when the kind changes (or a tool call starts) and closing
    before the next one opens. A tool call's arguments follow its start."""

    message_id: str
    model: str
    input_tokens: int  # the prompt's, for message_start (message_delta has the record's)
    _open: str | None = None  # the kind of the open block: "thinking", "text", "tool_use"
    _blocks: int = 0  # blocks opened so far; the open one is the last
    _called_tools: bool = False

    def opening(self) -> list[str]:
        """message_start, then a ping."""
        start = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": 0},
        }
        return [
            event("message_start", {"type": "message_start", "message": start}),
            event("ping", {"type": "ping"}),
        ]

    def part(self, part: AnswerPart) -> list[str]:
        if isinstance(part, ToolCallStarted):
            self._called_tools = True
            block = {"type": "tool_use", "id": new_id("toolu"), "name": part.name, "input": {}}
            return self._start("tool_use", block)
        if isinstance(part, ToolCallArguments):
            delta = {"type": "input_json_delta", "partial_json": part.text}
            return [self._delta(delta)] if part.text else []
        if not part.text:
            return []
        kind = BLOCK_OF[type(part)]
        opened = []
        if self._open != kind:
            empty = {"type": kind, kind: ""} | ({"signature": ""} if kind == "thinking" else {})
            opened = self._start(kind, empty)
        return [*opened, self._delta({"type": DELTA_OF[kind], kind: part.text})]

    def closing(self, record: RunRecord) -> list[str]:
        """The open block's end, message_delta (why it stopped, the usage and the run
        record), message_stop."""
        delta = {
            "type": "message_delta",
            "delta": {
                "stop_reason": stop_reason(record, self._called_tools),
                "stop_sequence": record.stop_string,
            },
            "usage": usage(record),
            "x_mlxspec": record.to_dict(),
        }
        return [
            *self._stop(),
            event("message_delta", delta),
            event("message_stop", {"type": "message_stop"}),
        ]

    def _start(self, kind: str, block: dict) -> list[str]:
        stopped = self._stop()
        self._open, self._blocks = kind, self._blocks + 1
        start = {"type": "content_block_start", "index": self._blocks - 1, "content_block": block}
        return [*stopped, event("content_block_start", start)]

    def _delta(self, delta: dict) -> str:
        payload = {"type": "content_block_delta", "index": self._blocks - 1, "delta": delta}
        return event("content_block_delta", payload)

    def _stop(self) -> list[str]:
        if self._open is None:
            return []
        self._open = None
        stop = {"type": "content_block_stop", "index": self._blocks - 1}
        return [event("content_block_stop", stop)]


# --- Errors -----------------------------------------------------------------------------

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


def error_body(err: ApiError) -> dict:
    """An error as Anthropic's API gives it: its kind from the status."""
    fallback = "invalid_request_error" if err.status_code < 500 else "api_error"
    kind = ERROR_TYPES.get(err.status_code, fallback)
    message = err.message
    if isinstance(err, ContextExceeded):  # Anthropic's words, which Claude Code acts on
        message = f"prompt is too long: {err.prompt_tokens} tokens > {err.context} maximum"
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_event(err: ApiError) -> str:
    """An error after the stream has begun, too late for a status."""
    return event("error", error_body(err))
