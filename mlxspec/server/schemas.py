"""Request bodies of the OpenAI-compatible endpoints, as pydantic models.

Strict types: "5" is not a number and 1 is not a boolean, so a client bug is reported
rather than guessed at. Fields of OpenAI's API that mlxspec does not use (user,
...) are ignored so that stock clients work; the `mlxspec` extension object is
ours, so a misspelt key in it is refused.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

from mlxspec.conversation import Conversation
from mlxspec.logprobs import MAX_TOP_LOGPROBS
from mlxspec.server.errors import ApiError
from mlxspec.server.logprobs import MAX_COMPLETION_LOGPROBS

NonEmptyText = Annotated[str, Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0)]
StopStrings = Annotated[list[str], Field(max_length=4)]
Count = Annotated[int, Field(ge=1)]


class MlxspecOptions(BaseModel):
    """The `mlxspec` extension object of a request."""

    model_config = ConfigDict(strict=True, extra="forbid")

    proposer: str | None = Field(None, description="A proposer of the model, or 'none'.")
    k: int | None = Field(None, ge=0, le=256, description="Fixed draft length; omit: adaptive.")
    tree: bool | None = Field(None, description="Verify draft trees; omit: the model's setting.")
    provenance: bool = Field(False, description="Mark each streamed piece accepted/target.")
    history: bool | None = Field(
        None,
        description="false: neither read nor add to the model's history of requests "
        "(suffix decoding); omit: the model's setting.",
    )


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    include_usage: bool = False


class GenerationRequest(BaseModel):
    """What chat and text completions share."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = Field(None, description="A registry name; omit for the default.")
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = Field(None, description="Wins over max_tokens.")
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | StopStrings | None = None
    n: Count | None = Field(1, description="Only 1 is supported.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    mlxspec: MlxspecOptions = Field(default_factory=MlxspecOptions)

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def alternatives(self) -> int | None:
        """How many likeliest alternatives to report with each token's logprob (None: no
        logprobs); each dialect asks for them its own way, and one without them (Anthropic's)
        asks for none."""
        return None


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["text"]
    text: str


class FunctionSpec(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    name: NonEmptyText
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON Schema object.")


class Tool(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["function"]
    function: FunctionSpec

    def for_template(self) -> dict[str, Any]:
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class CalledFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    name: NonEmptyText
    arguments: str = Field(description="The arguments, a JSON object as text.")

    @field_validator("arguments")
    @classmethod
    def _an_object(cls, arguments: str) -> str:
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError as err:
            raise ValueError(f"must be a JSON object as text: {err}") from None
        if not isinstance(parsed, dict):
            raise ValueError("must be a JSON object as text")
        return arguments


class CallMade(BaseModel):
    """An assistant turn's tool call, as the client sends the history back."""

    model_config = ConfigDict(strict=True, extra="ignore")

    id: NonEmptyText
    type: Literal["function"] = "function"
    function: CalledFunction

    def for_template(self) -> dict[str, Any]:
        """Arguments as a dict: templates iterate over them or write them with tojson."""
        function = {"name": self.function.name, "arguments": json.loads(self.function.arguments)}
        return {"id": self.id, "type": "function", "function": function}


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[CallMade] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _whole(self) -> Message:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content: only an assistant turn with tool_calls may have none")
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"tool_calls: only an assistant turn makes them, not {self.role}")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("tool_call_id: a tool message must name the call it answers")
        return self

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def for_template(self, call_names: dict[str, str]) -> dict[str, Any]:
        """The message as chat templates expect it. `call_names`: the function each earlier
        call id named (a tool result carries its function's name, as some templates write)."""
        role = "system" if self.role == "developer" else self.role  # OpenAI's newer name
        message: dict[str, Any] = {"role": role, "content": self.text}
        if self.tool_calls:
            message["tool_calls"] = [call.for_template() for call in self.tool_calls]
        if self.role == "tool":
            message["tool_call_id"] = self.tool_call_id
            message["name"] = self.name or call_names[self.tool_call_id]
        return message


class NamedFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    name: NonEmptyText


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["function"]
    function: NamedFunction


class ChatRequest(GenerationRequest):
    messages: Annotated[list[Message], Field(min_length=1)]
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = Field(
        None, description="Accepted; the calls the model makes are all returned."
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Extra arguments of the chat template, e.g. {enable_thinking: false}."
    )

    def conversation(self, template_defaults: dict[str, Any]) -> Conversation:
        """The request as the one shape inside. Tools go to the template unless
        tool_choice is "none"; `template_defaults` (the model's) yield to the request's."""
        if self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice):
            raise ApiError(
                400,
                "tool_choice: 'required' and a named function need constrained decoding, which "
                "this server does not have yet; use 'auto' or 'none'",
                code="unsupported_value",
                param="tool_choice",
            )
        call_names: dict[str, str] = {}
        messages = []
        for index, message in enumerate(self.messages):
            if message.role == "tool" and message.tool_call_id not in call_names:
                raise ApiError(
                    400,
                    f"messages[{index}].tool_call_id: {message.tool_call_id!r} answers no "
                    "tool call of an earlier assistant message",
                    code="invalid_value",
                    param=f"messages[{index}].tool_call_id",
                )
            call_names.update((call.id, call.function.name) for call in message.tool_calls or ())
            messages.append(message.for_template(call_names))
        tools = None
        if self.tools and self.tool_choice != "none":
            tools = [tool.for_template() for tool in self.tools]
        return Conversation(
            messages, tools, {**template_defaults, **(self.chat_template_kwargs or {})}
        )

    def alternatives(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs is not None:
                raise ApiError(
                    400,
                    "top_logprobs: set logprobs to true to ask for it",
                    code="invalid_value",
                    param="top_logprobs",
                )
            return None
        return self.top_logprobs or 0


class CompletionRequest(GenerationRequest):
    prompt: (
        NonEmptyText
        | Annotated[list[NonEmptyText], Field(min_length=1)]
        | Annotated[list[TokenId], Field(min_length=1)]
    ) = Field(description="Text, a list of one text, or token ids (one prompt per request).")
    logprobs: int | None = Field(
        None, ge=0, le=MAX_COMPLETION_LOGPROBS, description="Alternatives per token (legacy)."
    )

    def alternatives(self) -> int | None:
        return self.logprobs

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _one_reason(cls, value: Any, validate: ValidatorFunctionWrapHandler) -> Any:
        """One clear reason instead of one failure per member of the union."""
        try:
            return validate(value)
        except ValidationError:
            raise ValueError(
                "must be a non-empty string, a list of one such string, "
                "or a non-empty list of token ids (integers >= 0)"
            ) from None

    def prompt_input(self) -> str | list[int]:
        if isinstance(self.prompt, list) and isinstance(self.prompt[0], str):
            if len(self.prompt) > 1:
                raise ApiError(
                    400,
                    f"prompt: send one prompt per request, not {len(self.prompt)}",
                    code="invalid_value",
                    param="prompt",
                )
            return self.prompt[0]
        return self.prompt
