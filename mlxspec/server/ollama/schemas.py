"""Ollama's request bodies (`/api/chat`, `/api/generate`, `/api/show`), as pydantic models,
and their translation into the one request shape inside: the fields the server's settings
read (`GenerationRequest`) and the prompt (a `Conversation`, raw text or an `Infill`).

Shapes as ollama/ollama's api/types.go has them, and as its clients send them: Zed writes
`null` for an absent `tool_calls`, `thinking` or `options`; Continue adds options this
server has no use for (`num_thread`, `mirostat`, `min_p`): both are accepted.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field

from mlxspec.markup.conversation import Conversation
from mlxspec.markup.fim import Infill
from mlxspec.server.errors import ApiError, invalid_value
from mlxspec.server.request_body import (
    GenerationRequest,
    Lenient,
    MlxspecOptions,
    ResponseFormat,
    Tool,
    effort_kwargs,
)

Think = bool | Literal["low", "medium", "high"]
# A JSON schema the answer must match, or "json" for any JSON object ("": no format).
Format = Literal["", "json"] | dict[str, Any]
KeepAlive = int | float | str  # accepted; one model stays resident here whatever it says


class Options(Lenient):
    """Ollama's `options` (its Modelfile parameters): the sampling ones are honoured;
    `num_ctx` and the runner's (`num_thread`, `num_gpu`...) are accepted and ignored,
    since the model's context is set where it is served (models.toml)."""

    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None  # 0 or less: off, as in Ollama
    num_predict: int | None = None  # -1 (endless) and -2 (fill the context): the default
    stop: list[str] | None = None
    seed: int | None = None  # negative: random, as in Ollama
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    num_ctx: int | None = None


class CalledFunction(Lenient):
    index: int | None = None
    name: Annotated[str, Field(min_length=1)]
    arguments: dict[str, Any] | str = Field(default_factory=dict)


class ToolCall(Lenient):
    id: str | None = None
    function: CalledFunction


class Message(Lenient):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    thinking: str | None = None
    images: list[str] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None


class ShowRequest(Lenient):
    """`model`, or `name` as older clients send it (Continue)."""

    model: str | None = None
    name: str | None = None
    verbose: bool | None = None

    @property
    def asked(self) -> str | None:
        return self.model or self.name


class Asking(Lenient):
    """What chat and generate share."""

    model: str | None = Field(None, description="A registry name; omit for the default.")
    stream: bool | None = Field(None, description="Omitted: true, as in Ollama.")
    format: Format | None = None
    options: Options | None = None
    keep_alive: KeepAlive | None = None
    think: Think | None = None
    mlxspec: MlxspecOptions = Field(default_factory=MlxspecOptions)

    @property
    def streamed(self) -> bool:
        return self.stream is not False

    def generation_request(self) -> GenerationRequest:
        """The fields the server's settings read, in the shape the OpenAI routes give
        them (top_k, which OpenAI lacks, is `top_k()`). Ollama's own conventions (negative
        seeds and lengths) become 'the default'."""
        options = self.options or Options()
        given = options.num_predict
        return GenerationRequest.model_construct(
            model=self.model,
            max_tokens=given if given is not None and given > 0 else None,
            temperature=options.temperature,
            top_p=options.top_p,
            presence_penalty=options.presence_penalty,
            frequency_penalty=options.frequency_penalty,
            seed=options.seed if options.seed is not None and options.seed >= 0 else None,
            stop=options.stop,
            stream=self.streamed,
            mlxspec=self.mlxspec,
            response_format=_response_format(self.format),
        )

    def top_k(self) -> int | None:
        top_k = self.options.top_k if self.options else None
        return None if top_k is None else max(top_k, 0)

    def template_kwargs(self, defaults: dict[str, Any]) -> dict[str, Any]:
        """The model's template arguments with `think`: a switch (Qwen3's
        enable_thinking) or an effort (gpt-oss's reasoning_effort)."""
        if isinstance(self.think, str):
            return effort_kwargs(self.think, defaults)
        kwargs = dict(defaults)
        if self.think is not None:
            kwargs["enable_thinking"] = self.think
        return kwargs


class ChatRequest(Asking):
    messages: list[Message] = Field(default_factory=list)  # none: load the model
    tools: list[Tool] | None = None

    def conversation(self, template_defaults: dict[str, Any]) -> Conversation:
        """The messages as chat templates take them: tool calls with ids (Ollama's have
        none: made here), each tool result tied to the call it answers by its id, else
        by its `tool_name`, else to the next call not yet answered."""
        messages: list[dict[str, Any]] = []
        unanswered: list[tuple[str, str]] = []  # (id, name) of the calls made so far
        for index, message in enumerate(self.messages):
            where = f"messages[{index}]"
            if message.images:
                raise _no_images(f"{where}.images")
            turn: dict[str, Any] = {"role": message.role, "content": message.content or ""}
            if message.role == "assistant":
                if message.thinking:
                    turn["reasoning_content"] = message.thinking
                calls = [
                    _call(call, f"{where}.tool_calls[{n}]", len(unanswered) + n)
                    for n, call in enumerate(message.tool_calls or ())
                ]
                if calls:
                    turn["tool_calls"] = calls
                unanswered += [(call["id"], call["function"]["name"]) for call in calls]
            elif message.role == "tool":
                call_id, name = _answered(message, unanswered, index)
                turn.update(tool_call_id=call_id, name=name)
            messages.append(turn)
        tools = [tool.for_template() for tool in self.tools] if self.tools else None
        return Conversation(messages, tools, self.template_kwargs(template_defaults))


class GenerateRequest(Asking):
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False
    images: list[str] | None = None

    @property
    def loads_only(self) -> bool:
        """An empty prompt and no suffix: Ollama loads the model and answers at once."""
        return not self.prompt and not self.suffix

    def prompt_input(self, template_defaults: dict[str, Any]) -> str | Conversation | Infill:
        """A `suffix` makes a fill-in-the-middle prompt (with or without `raw`: the
        model's FIM tokens are its template for it); `raw` the prompt as it is; else the
        prompt is the user's turn of the model's chat template, after `system`."""
        if self.images:
            raise _no_images("images")
        if self.template:
            raise invalid_value(
                "template",
                "this server applies the model's own template; send the prompt already "
                "templated with raw: true instead",
            )
        if self.context:
            raise invalid_value(
                "context",
                "is not supported (it is deprecated in Ollama); send the conversation to "
                "/api/chat, or the whole prompt with raw: true",
            )
        if self.suffix:
            if self.system:
                raise invalid_value("system", "a fill-in-the-middle prompt has no place for it")
            return Infill(prefix=self.prompt, suffix=self.suffix)
        if self.raw:
            if self.system:
                raise invalid_value("system", "raw mode does not use it; put it in the prompt")
            return self.prompt
        system = [{"role": "system", "content": self.system}] if self.system else []
        messages = [*system, {"role": "user", "content": self.prompt}]
        return Conversation(messages, None, self.template_kwargs(template_defaults))


def _response_format(given: Format | None) -> ResponseFormat | None:
    """Ollama's `format` as OpenAI's `response_format`, so the answer is constrained the
    one way: "json" any JSON object, a schema that schema (leniently, as Ollama does)."""
    if not given:
        return None
    if given == "json":
        return ResponseFormat(type="json_object")
    if isinstance(given, dict):
        return ResponseFormat.model_validate(
            {"type": "json_schema", "json_schema": {"name": "format", "schema": given}}
        )
    raise invalid_value("format", 'must be "json" or a JSON schema object')


def _call(call: ToolCall, where: str, number: int) -> dict[str, Any]:
    """An earlier call, as templates take it: arguments an object (Ollama sends one;
    some clients send its JSON text)."""
    arguments = call.function.arguments
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            arguments = None
        if not isinstance(arguments, dict):
            raise invalid_value(f"{where}.function.arguments", "must be a JSON object")
    call_id = call.id or f"call_{number}"
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": call.function.name, "arguments": arguments},
    }


def _answered(message: Message, unanswered: list[tuple[str, str]], index: int) -> tuple[str, str]:
    """(call id, tool name) of the call a tool result answers; it is answered now."""
    found = next(
        (
            call
            for call in unanswered
            if call[0] == message.tool_call_id
            or (message.tool_call_id is None and call[1] == message.tool_name)
        ),
        None,
    )
    if found is None and message.tool_call_id is None and message.tool_name is None:
        found = unanswered[0] if unanswered else None
    if found is None:  # a result of a call the history does not hold: keep it, named
        return message.tool_call_id or f"result_{index}", message.tool_name or "tool"
    unanswered.remove(found)
    return found[0], message.tool_name or found[1]


def _no_images(param: str) -> ApiError:
    return invalid_value(param, "this server runs text models only; send no images")
