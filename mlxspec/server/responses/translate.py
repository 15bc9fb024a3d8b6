"""The Responses API, translated: input items into a `Conversation` and the fields the server's
settings read; an answer's parts into output items, or into the Responses stream of events.

Pure functions and one stream's state, as the Anthropic dialect's translate.py, so each
translation is tested on its own. Input items become chat-template messages: `system` and
`developer` messages join the system prompt in order (templates take one, first); a
`function_call` joins the assistant turn before it as a tool call (or opens one); a
`function_call_output` is a tool message; a `reasoning` item is the next assistant turn's
`reasoning_content`. A `namespace`'s functions (Codex's sub-agents, its MCP servers' tools)
are offered under the name Codex itself joins them by (`flat_name`: `ns__tool`), and a call
to one comes back as a `function_call` with the bare name and its `namespace`. Hosted tools
(web search, file search, computer use, MCP run by the API) run nowhere here: dropped, and
the response says which (`answering.DROPPED_HEADER`).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from mlxspec.events import RunRecord
from mlxspec.markup.conversation import (
    AnswerPart,
    Conversation,
    ParsedAnswer,
    ReasoningText,
    ToolCallArguments,
    ToolCallStarted,
)
from mlxspec.server.errors import ApiError, invalid_value
from mlxspec.server.request_body import GenerationRequest, check_forced_schemas, effort_kwargs
from mlxspec.server.responses.schemas import (
    AllowedTools,
    ContentPart,
    InputItem,
    NamedTool,
    ResponsesRequest,
    TextFormat,
    ToolSpec,
)
from mlxspec.structured.answer import AnswerConstraint
from mlxspec.structured.forced_tools import ForcedTools

CONTENT_PART_ADDED, CONTENT_PART_DONE = "response.content_part.added", "response.content_part.done"
TEXT_DELTA, TEXT_DONE = "response.output_text.delta", "response.output_text.done"
REASONING_DELTA = "response.reasoning_text.delta"
TEXT_PARTS = {"input_text", "output_text", "text", "summary_text", "reasoning_text"}


def new_id(prefix: str) -> str:
    """OpenAI-style ids: resp_, msg_, fc_, rs_, call_."""
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


# --- The request ------------------------------------------------------------------------


def input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's own input as plain items (a string is one user message), as they are
    stored for a later `previous_response_id`."""
    if isinstance(body.input, str):
        return [{"type": "message", "role": "user", "content": body.input}] if body.input else []
    return [item.model_dump(exclude_none=True, by_alias=True) for item in body.input]


def _text(content: str | list[ContentPart] | list[dict] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for index, part in enumerate(content):
        part = part if isinstance(part, ContentPart) else ContentPart.model_validate(part)
        if part.type in TEXT_PARTS:
            texts.append(part.text or "")
        elif part.type == "refusal":
            texts.append(part.refusal or "")
        else:
            raise invalid_value(
                f"{where}[{index}]", f"{part.type} parts are not supported by this server"
            )
    return "".join(texts)


def conversation(
    items: list[dict[str, Any]],
    instructions: str | None,
    tools: list[dict] | None,
    template_kwargs: dict[str, Any],
) -> Conversation:
    """Plain input items (earlier turns' first) as the one request shape inside."""
    system = [instructions] if instructions else []
    messages: list[dict[str, Any]] = []
    call_names: dict[str, str] = {}  # call_id -> the function it called
    reasoning: list[str] = []  # for the next assistant turn
    for position, raw in enumerate(items):
        item = InputItem.model_validate(raw)
        where = f"input[{position}]"
        if item.type == "message":
            text = _text(item.content, f"{where}.content")
            if item.role in ("system", "developer"):
                system.append(text)
            elif item.role == "assistant":
                turn = {"role": "assistant", "content": text}
                messages.append(_with_reasoning(turn, reasoning))
            elif item.role == "user":
                messages.append({"role": "user", "content": text})
            else:
                raise invalid_value(f"{where}.role", "a message needs a role")
        elif item.type in ("function_call", "custom_tool_call"):
            if not item.call_id or not item.name:
                raise invalid_value(where, f"a {item.type} needs call_id and name")
            arguments = _arguments(item, where)
            name = flat_name(item.namespace, item.name)
            call_names[item.call_id] = name
            call = {"id": item.call_id, "type": "function"}
            call["function"] = {"name": name, "arguments": arguments}
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = _with_reasoning({"role": "assistant", "content": ""}, reasoning)
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif item.type in ("function_call_output", "custom_tool_call_output"):
            if item.call_id not in call_names:
                raise invalid_value(
                    f"{where}.call_id", f"{item.call_id!r} answers no earlier function_call"
                )
            output = _text(item.output, f"{where}.output")
            tool_turn = {"role": "tool", "tool_call_id": item.call_id}
            messages.append({**tool_turn, "name": call_names[item.call_id], "content": output})
        elif item.type == "reasoning":
            parts = item.content if isinstance(item.content, list) else []
            reasoning.append(_text([*parts, *(item.summary or [])], f"{where}.content"))
        elif item.type == "item_reference":
            raise invalid_value(where, "item references are not supported; send the item itself")
        # Hosted tools' calls (web_search_call, ...) ran nowhere here: nothing to show.
    if system:
        messages.insert(0, {"role": "system", "content": "\n\n".join(system)})
    return Conversation(messages, tools, template_kwargs)


def _with_reasoning(turn: dict, reasoning: list[str]) -> dict:
    if any(reasoning):
        turn["reasoning_content"] = "\n".join(text for text in reasoning if text)
    reasoning.clear()
    return turn


def _arguments(item: InputItem, where: str) -> dict[str, Any]:
    """A call's arguments as the dict templates iterate over; a custom tool's free text
    under "input", as it is offered to the model (`tools_for_template`)."""
    if item.type == "custom_tool_call":
        return {"input": item.input or ""}
    try:
        parsed = json.loads(item.arguments or "{}")
    except json.JSONDecodeError as err:
        raise invalid_value(f"{where}.arguments", f"must be a JSON object as text: {err}") from None
    if not isinstance(parsed, dict):
        raise invalid_value(f"{where}.arguments", "must be a JSON object as text")
    return parsed


NAMESPACE_SEAM = "__"  # Codex's, between a namespace and its tool in a flat name


def flat_name(namespace: str | None, name: str) -> str:
    """A tool's name as the model sees it: a namespaced one joined as Codex joins them
    where a boundary cannot keep the two apart (its `ToolName::canonical_flat_name`:
    `mcp__docs__` and `search` make `mcp__docs__search`)."""
    if not namespace:
        return name
    return f"{namespace.rstrip('_')}{NAMESPACE_SEAM}{name.lstrip('_')}"


@dataclass(frozen=True)
class Tools:
    """The request's tools as the template sees them, the names of custom (free-text)
    tools, the namespaced ones (flat name -> namespace, bare name), and what was dropped."""

    for_template: list[dict] | None
    custom: frozenset[str] = frozenset()
    dropped: tuple[str, ...] = ()
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)

    def called(self, name: str) -> dict[str, str]:
        """A call's naming fields in an output item: a namespaced tool's bare name and
        its `namespace` (what Codex reads), else the name as the model wrote it."""
        if name in self.namespaced:
            namespace, bare = self.namespaced[name]
            return {"name": bare, "namespace": namespace}
        return {"name": name}


def tools(body: ResponsesRequest) -> Tools:
    if not body.tools:
        return Tools(None)
    offered, custom, dropped, namespaced = [], set(), [], {}
    for spec in body.tools:
        if spec.type == "function" and spec.name:
            offered.append(_function(spec.name, spec.description, spec.parameters))
        elif spec.type == "custom" and spec.name:
            custom.add(spec.name)
            offered.append(_function(spec.name, _custom_description(spec), _FREE_TEXT))
        elif spec.type == "namespace" and spec.name and spec.tools:
            for inner in spec.tools:
                if inner.type != "function" or not inner.name:
                    dropped.append(f"{spec.name}.{inner.name or inner.type}")
                    continue
                name = flat_name(spec.name, inner.name)
                namespaced[name] = (spec.name, inner.name)
                offered.append(_function(name, inner.description, inner.parameters))
        else:
            dropped.append(spec.name or spec.type)
    shown = offered if offered and body.tool_choice != "none" else None
    return Tools(shown, frozenset(custom), tuple(dropped), namespaced)


_FREE_TEXT = {
    "type": "object",
    "properties": {"input": {"type": "string", "description": "The tool's input, as text."}},
    "required": ["input"],
}


def _function(name: str, description: str | None, parameters: dict | None) -> dict:
    function = {"name": name, "description": description or ""}
    function["parameters"] = parameters if parameters is not None else {"type": "object"}
    return {"type": "function", "function": function}


def _custom_description(spec: ToolSpec) -> str:
    """A custom tool, for a model that only knows JSON-argument calls: its free-text input,
    and the grammar it must match where the tool has one."""
    text = spec.description or ""
    grammar = spec.format or {}
    if grammar.get("type") == "grammar" and grammar.get("definition"):
        syntax = grammar.get("syntax", "lark")
        text += f"\nThe input must match this {syntax} grammar:\n{grammar['definition']}"
    return text.strip()


def answer_constraint(body: ResponsesRequest, offered: Tools) -> AnswerConstraint | None:
    """The forced calls of `tool_choice` ("required": one of the tools; a named tool: it),
    else `text.format`'s; ApiError (400) for a choice the tools cannot meet."""
    choice = body.tool_choice
    names: tuple[str, ...] = ()
    if choice == "required" or (isinstance(choice, AllowedTools) and choice.mode == "required"):
        names = tuple(tool["function"]["name"] for tool in offered.for_template or ())
        if not names:
            raise invalid_value("tool_choice", "required, but no function tool was given")
    elif isinstance(choice, NamedTool):
        known = {tool["function"]["name"] for tool in offered.for_template or ()}
        name = flat_name(choice.namespace, choice.name)
        if name not in known:
            raise invalid_value("tool_choice", f"no tool named {name!r} is in tools")
        names = (name,)
    text_format = body.text.format if body.text else None
    if names:
        if text_format is not None and text_format.type != "text":
            raise invalid_value(
                "text.format", "a forced tool_choice already sets the answer's form"
            )
        check_forced_schemas(
            [
                (f"tools[{index}].parameters", spec.parameters)
                for index, spec in enumerate(body.tools or ())
                if spec.type == "function" and spec.name in names
            ]
        )
        forced = ForcedTools(names, parallel=body.parallel_tool_calls is True)
        return AnswerConstraint(tools=forced, param="tool_choice")
    if text_format is None:
        return None
    if text_format.type == "json_schema" and text_format.schema_ is None:
        raise invalid_value("text.format.schema", "a json_schema format needs its schema")
    grammar = text_format.response_format().grammar("text.format.schema")
    return None if grammar is None else AnswerConstraint(grammar=grammar)


def template_kwargs(body: ResponsesRequest, defaults: dict[str, Any]) -> dict[str, Any]:
    """The model's template arguments, then `reasoning.effort`, then the request's own."""
    effort = body.reasoning.effort if body.reasoning else None
    return {**effort_kwargs(effort, defaults), **(body.chat_template_kwargs or {})}


def generation_request(body: ResponsesRequest, max_tokens_limit: int) -> GenerationRequest:
    """The fields the server's settings read, in the shape the OpenAI routes give them;
    `max_output_tokens` clamped to the server's limit (the record says what was granted)."""
    asked = body.max_output_tokens
    return GenerationRequest.model_construct(
        model=body.model,
        max_tokens=None if asked is None else min(asked, max_tokens_limit),
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        stop=body.stop,
        stream=body.stream,
        mlxspec=body.mlxspec,
    )


# --- The answer -------------------------------------------------------------------------


def usage(record: RunRecord) -> dict:
    return {
        "input_tokens": record.prompt_tokens,
        "input_tokens_details": {"cached_tokens": record.reused_prompt_tokens},
        "output_tokens": record.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": record.reasoning_tokens},
        "total_tokens": record.prompt_tokens + record.completion_tokens,
    }


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {
        "type": "message",
        "id": item_id,
        "role": "assistant",
        "status": status,
        "content": content if status == "completed" else [],
    }


def call_item(
    item_id: str,
    call_id: str,
    naming: dict[str, str],
    arguments: str,
    custom: bool,
    status: str = "completed",
) -> dict:
    """A function call, or a custom tool's call with its free text as `input`; `naming`,
    its name (and namespace: `Tools.called`)."""
    if custom:
        text = _custom_input(arguments)
        item = {"type": "custom_tool_call", "id": item_id, "call_id": call_id, **naming}
        return {**item, "input": text, "status": status}
    item = {"type": "function_call", "id": item_id, "call_id": call_id, **naming}
    return {**item, "arguments": arguments, "status": status}


def _custom_input(arguments: str) -> str:
    try:
        parsed = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return arguments
    return parsed.get("input", arguments) if isinstance(parsed, dict) else arguments


def output_items(answer: ParsedAnswer, offered: Tools) -> list[dict]:
    """A whole answer as output items: its reasoning, its text, its calls, in that order."""
    items = []
    if answer.reasoning:
        items.append(reasoning_item(new_id("rs"), answer.reasoning))
    if answer.text:
        items.append(message_item(new_id("msg"), answer.text))
    for call in answer.tool_calls:
        custom_call, naming = call.name in offered.custom, offered.called(call.name)
        items.append(call_item(new_id("fc"), call.id, naming, call.arguments, custom_call))
    return items


@dataclass
class Envelope:
    """What a response says of its request, the same in every event that carries it."""

    response_id: str
    model: str
    body: ResponsesRequest
    created_at: int = field(default_factory=lambda: int(time.time()))

    def response(
        self, status: str, output: list[dict], record: RunRecord | None = None, error=None
    ) -> dict:
        body = self.body
        incomplete = None
        if record is not None and status == "incomplete":
            incomplete = {"reason": "max_output_tokens"}
        text_format = body.text.format if body.text and body.text.format else None
        response = {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.model,
            "output": output,
            "error": error,
            "incomplete_details": incomplete,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": body.reasoning.model_dump() if body.reasoning else None,
            "store": body.store,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "text": {"format": _format(text_format)},
            "tool_choice": _choice(body),
            "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or ()],
            "truncation": "disabled",
            "metadata": body.metadata or {},
            "usage": usage(record) if record is not None else None,
        }
        if record is not None:
            response["x_mlxspec"] = record.to_dict()
        return response


def _format(text_format: TextFormat | None) -> dict:
    return text_format.model_dump(by_alias=True) if text_format else {"type": "text"}


def _choice(body: ResponsesRequest) -> Any:
    choice = body.tool_choice
    if choice is None or isinstance(choice, str):
        return choice or "auto"
    return choice.model_dump()


def status_of(record: RunRecord, answer: ParsedAnswer) -> str:
    """`incomplete` where the answer reached its token limit before it ended."""
    cut = record.finish_reason == "length" and not answer.tool_calls
    return "incomplete" if cut else "completed"


def event(payload: dict) -> str:
    """One server-sent event as the Responses API streams them: its type on an `event:`
    line and in the data."""
    return f"event: {payload['type']}\ndata: {json.dumps(payload)}\n\n"


@dataclass
class ResponseStream:
    """One streamed response's events, each with its `sequence_number`: an output item
    opens when the kind of part changes (or a call starts) and is done before the next
    one opens; the response's full output rides on `response.completed`."""

    envelope: Envelope
    offered: Tools = field(default_factory=lambda: Tools(None))
    output: list[dict] = field(default_factory=list)  # the items done so far
    final: dict | None = None  # the response as it ended
    _sequence: int = 0
    _open: dict | None = None  # the open item, its text gathered in "_text"

    def _event(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event(payload)

    def opening(self) -> list[str]:
        response = self.envelope.response("in_progress", [])
        return [
            self._event("response.created", response=response),
            self._event("response.in_progress", response=response),
        ]

    def part(self, part: AnswerPart) -> list[str]:
        if isinstance(part, ToolCallStarted):
            custom, naming = part.name in self.offered.custom, self.offered.called(part.name)
            item = call_item(new_id("fc"), part.id, naming, "", custom, "in_progress")
            return [*self._close(), *self._add(item)]
        if isinstance(part, ToolCallArguments):
            if not part.text or self._open is None or "call_id" not in self._open:
                return []
            self._open["_text"] += part.text
            if self._open["type"] == "custom_tool_call":
                return []  # its input is free text, told whole when the call is done
            ids = self._ids()
            return [self._event("response.function_call_arguments.delta", **ids, delta=part.text)]
        if not part.text:
            return []
        kind = "reasoning" if isinstance(part, ReasoningText) else "message"
        opened = []
        if self._open is None or self._open["type"] != kind:
            if kind == "reasoning":
                item = reasoning_item(new_id("rs"), "", "in_progress")
            else:
                item = message_item(new_id("msg"), "", "in_progress")
            opened = [*self._close(), *self._add(item)]
            if kind == "message":
                empty = {"type": "output_text", "text": "", "annotations": []}
                opened.append(self._event(CONTENT_PART_ADDED, **self._ids(0), part=empty))
        self._open["_text"] += part.text
        if kind == "reasoning":
            return [*opened, self._event(REASONING_DELTA, **self._ids(0), delta=part.text)]
        delta = self._event(TEXT_DELTA, **self._ids(0), delta=part.text, logprobs=[])
        return [*opened, delta]

    def closing(self, record: RunRecord, answer: ParsedAnswer) -> list[str]:
        """The open item's end, then `response.completed` (or `.incomplete`, at the token
        limit) with the whole response, kept as `final`."""
        closed = self._close()
        status = status_of(record, answer)
        self.final = self.envelope.response(status, self.output, record)
        return [*closed, self._event(f"response.{status}", response=self.final)]

    def failing(self, err: ApiError) -> list[str]:
        """An error after the stream began: the open item ends, the response failed."""
        closed = self._close()
        error = {"code": err.code or "server_error", "message": err.message}
        response = self.envelope.response("failed", self.output, error=error)
        return [*closed, self._event("response.failed", response=response)]

    def _ids(self, content_index: int | None = None) -> dict:
        ids = {"item_id": self._open["id"], "output_index": len(self.output)}
        return ids if content_index is None else {**ids, "content_index": content_index}

    def _add(self, item: dict) -> list[str]:
        self._open = {**item, "_text": ""}
        return [self._event("response.output_item.added", output_index=len(self.output), item=item)]

    def _close(self) -> list[str]:
        if self._open is None:
            return []
        item, text = dict(self._open), self._open["_text"]
        del item["_text"]
        events = []
        if item["type"] == "reasoning":
            item = reasoning_item(item["id"], text)
            events.append(self._event("response.reasoning_text.done", **self._ids(0), text=text))
        elif item["type"] == "message":
            item = message_item(item["id"], text)
            part = item["content"][0]
            events.append(self._event(TEXT_DONE, **self._ids(0), text=text, logprobs=[]))
            events.append(self._event(CONTENT_PART_DONE, **self._ids(0), part=part))
        else:
            custom = item["type"] == "custom_tool_call"
            naming = {key: item[key] for key in ("name", "namespace") if key in item}
            item = call_item(item["id"], item["call_id"], naming, text, custom)
            if custom:
                done = {**self._ids(), "input": item["input"]}
                events.append(self._event("response.custom_tool_call_input.done", **done))
            else:
                done = {**self._ids(), "name": item["name"], "arguments": text}
                events.append(self._event("response.function_call_arguments.done", **done))
        index = len(self.output)
        events.append(self._event("response.output_item.done", output_index=index, item=item))
        self.output.append(item)
        self._open = None
        return events
