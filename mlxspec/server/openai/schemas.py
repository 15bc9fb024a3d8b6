"""Request bodies of OpenAI's chat and text completions, as pydantic models, over the fields
every dialect shares (`server.request_body`).

Strict types, as there: a client bug is reported rather than guessed at.
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
from mlxspec.markup.fim import Infill
from mlxspec.server.errors import ApiError, invalid_value
from mlxspec.server.openai.logprobs import MAX_COMPLETION_LOGPROBS
from mlxspec.server.request_body import (
    GenerationRequest,
    NonEmptyText,
    TokenId,
    Tool,
    check_forced_schemas,
    effort_kwargs,
)
from mlxspec.structured.answer import AnswerConstraint
from mlxspec.structured.forced_tools import ForcedTools


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["text"]
    text: str


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
        None, description="true: a forced tool_choice may make more calls than one."
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Extra arguments of the chat template, e.g. {enable_thinking: false}."
    )
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = Field(
        None, description="To the template: gpt-oss's reasoning_effort; 'none': thinking off."
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
        kwargs = effort_kwargs(self.reasoning_effort, template_defaults)
        return Conversation(messages, tools, {**kwargs, **(self.chat_template_kwargs or {})})

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
        check_forced_schemas(
            [
                (f"tools[{index}].function.parameters", tool.function.parameters)
                for index, tool in enumerate(self.tools or ())
                if tool.function.name in names
            ]
        )
        # One call unless more are asked for: a forced choice is one call (SmolLM2 made
        # the same call twice, then began a third).
        return ForcedTools(names, parallel=self.parallel_tool_calls is True)


class CompletionRequest(GenerationRequest):
    prompt: (
        NonEmptyText
        | Annotated[list[NonEmptyText], Field(min_length=1)]
        | Annotated[list[TokenId], Field(min_length=1)]
    ) = Field(description="Text, a list of one text, or token ids (one prompt per request).")
    logprobs: int | None = Field(
        None, ge=0, le=MAX_COMPLETION_LOGPROBS, description="Alternatives per token (legacy)."
    )
    suffix: str | None = Field(
        None,
        description="The text after the completion (fill-in-the-middle, with the model's "
        "FIM tokens); empty or omitted: a plain completion of the prompt.",
    )
    echo: bool = Field(False, description="Give back the prompt before the completion.")

    def alternatives(self) -> int | None:
        return self.logprobs

    @model_validator(mode="after")
    def _echo_alone(self) -> CompletionRequest:
        """OpenAI's rules: an inserted completion is not echoed, and the prompt's own
        logprobs, which echo would owe, are not computed here."""
        if self.echo and self.suffix:
            raise ValueError("echo: not supported with suffix (an insertion is not echoed)")
        if self.echo and self.logprobs is not None:
            raise ValueError("echo: not supported with logprobs (the prompt's are not scored)")
        return self

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

    def echoed(self) -> str:
        """What `echo` gives back before the completion: the prompt's text ("": no echo)."""
        if not self.echo:
            return ""
        prompt = self.prompt[0] if isinstance(self.prompt, list) else self.prompt
        if not isinstance(prompt, str):
            raise invalid_value("echo", "send the prompt as text to have it echoed, not token ids")
        return prompt

    def prompt_input(self) -> str | list[int] | Infill:
        """The prompt as the engine takes it: text, token ids, or, with a `suffix`, the
        text before and after the hole (`Infill`)."""
        prompt = self.prompt
        if isinstance(prompt, list) and isinstance(prompt[0], str):
            if len(prompt) > 1:
                raise invalid_value("prompt", f"send one prompt per request, not {len(prompt)}")
            prompt = prompt[0]
        if not self.suffix:
            return prompt
        if not isinstance(prompt, str):
            raise invalid_value(
                "prompt", "with a suffix, send the text before the hole, not token ids"
            )
        return Infill(prefix=prompt, suffix=self.suffix)
