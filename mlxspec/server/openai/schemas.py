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

from mlxspec.logprobs import MAX_TOP_LOGPROBS
from mlxspec.markup.conversation import Conversation
from mlxspec.sampling import MAX_CONTEXT_SIZE
from mlxspec.server.errors import ApiError
from mlxspec.server.openai.logprobs import MAX_COMPLETION_LOGPROBS
from mlxspec.structured.answer import AnswerConstraint, grammar_problem
from mlxspec.structured.forced_tools import ForcedTools
from mlxspec.structured.grammar import Grammar

NonEmptyText = Annotated[str, Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0)]
StopStrings = Annotated[list[str], Field(max_length=4)]
Count = Annotated[int, Field(ge=1)]
ContextSize = Annotated[int, Field(ge=1, le=MAX_CONTEXT_SIZE)]


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


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`: the schema the answer must be valid against."""

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)

    name: NonEmptyText
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema", description="A JSON Schema object.")
    strict: bool | None = Field(
        None, description="true: a keyword that cannot be enforced is a 400; else ignored."
    )


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema: give it with type 'json_schema', and only then")
        return self

    def grammar(self) -> Grammar | None:
        """The grammar the answer must match (None: text), or ApiError (400) naming what
        of the schema cannot be enforced. Not strict: compiled leniently, so keywords
        llguidance cannot enforce are ignored (the answer may break them)."""
        if self.type == "text":
            return None
        if self.json_schema is None:
            return Grammar("json_object")
        schema, strict = self.json_schema.schema_, bool(self.json_schema.strict)
        lenient = {**schema, "x-guidance": {**schema.get("x-guidance", {}), "lenient": True}}
        grammar = Grammar.json_schema(schema if strict else lenient)
        problem = grammar_problem(grammar)
        if problem is not None:
            param = "response_format.json_schema.schema"
            if strict and grammar_problem(Grammar.json_schema(lenient)) is None:
                problem += "; remove it, or set strict to false to have it ignored"
            raise ApiError(400, f"{param}: {problem}", code="invalid_value", param=param)
        return grammar


class GenerationRequest(BaseModel):
    """What chat and text completions share."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = Field(None, description="A registry name; omit for the default.")
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = Field(None, description="Wins over max_tokens.")
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    # mlx-lm server's: how many of the last tokens (prompt included) each penalty counts
    presence_context_size: ContextSize = 20
    frequency_context_size: ContextSize = 20
    logit_bias: dict[str, Any] | None = Field(None, description="Not supported: only {}.")
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | StopStrings | None = None
    n: Count | None = Field(1, description="Only 1 is supported.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    mlxspec: MlxspecOptions = Field(default_factory=MlxspecOptions)
    response_format: ResponseFormat | None = None

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, bias: dict[str, Any] | None) -> dict[str, Any] | None:
        if bias:  # refused rather than ignored: the answer would not be what was asked
            raise ValueError("not supported; send none (or {})")
        return bias

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

    def answer_constraint(self) -> AnswerConstraint | None:
        """What the answer must match (`response_format`), or None: anything."""
        grammar = self.response_format.grammar() if self.response_format else None
        return None if grammar is None else AnswerConstraint(grammar=grammar)


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
    # An assistant turn's reasoning, as this server returns it (`reasoning_content`) or as
    # others name it (`reasoning`): templates show it where they keep earlier reasoning.
    reasoning_content: str | None = None
    reasoning: str | None = None

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
        reasoning = self.reasoning_content or self.reasoning
        if reasoning and self.role == "assistant":
            message["reasoning_content"] = reasoning
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
        None, description="false: a forced tool_choice makes one call; else as the model does."
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Extra arguments of the chat template, e.g. {enable_thinking: false}."
    )

    def conversation(self, template_defaults: dict[str, Any]) -> Conversation:
        """The request as the one shape inside. Tools go to the template unless
        tool_choice is "none"; `template_defaults` (the model's) yield to the request's."""
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

    def answer_constraint(self) -> AnswerConstraint | None:
        """`response_format`'s, or the forced tool calls of `tool_choice` ("required": a
        call to any of the tools; a named function: a call to it)."""
        forced = self._forced_tools()
        if forced is None:
            return super().answer_constraint()
        if self.response_format is not None and self.response_format.type != "text":
            raise ApiError(
                400,
                "response_format: a forced tool_choice already sets the answer's form; "
                "drop one of them",
                code="invalid_value",
                param="response_format",
            )
        return AnswerConstraint(tools=forced, param="tool_choice")

    def _forced_tools(self) -> ForcedTools | None:
        if self.tool_choice is None or isinstance(self.tool_choice, str):
            if self.tool_choice != "required":
                return None
            names = tuple(tool.function.name for tool in self.tools or ())
        else:
            names = (self.tool_choice.function.name,)
        known = {tool.function.name for tool in self.tools or ()}
        if not names or not set(names) <= known:
            what = f"no tool named {names[0]!r} is in tools" if names else "tools are empty"
            raise ApiError(400, f"tool_choice: {what}", code="invalid_value", param="tool_choice")
        return ForcedTools(names, parallel=self.parallel_tool_calls is not False)


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
