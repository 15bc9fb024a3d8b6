"""The body of `POST /v1/responses`, as pydantic models.

Input items are read by their `type`; an item of a type this server has no use for (a
hosted tool's call, an image) is refused or skipped by `translate`, not by validation, so
the reason names the item. Fields of the API that a local server does not use (`include`,
`prompt_cache_key`, `service_tier`, `truncation`, `user`, Codex's `client_metadata`) are
ignored and logged at debug level.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from mlxspec.server.request_body import (
    Count,
    JsonSchemaFormat,
    Lenient,
    MlxspecOptions,
    NonEmptyText,
    ResponseFormat,
    StopStrings,
)


class ContentPart(Lenient):
    """A message's part: input_text / output_text (text), refusal, or an image or file
    (refused by translate: no model here reads them)."""

    type: str
    text: str | None = None
    refusal: str | None = None


class InputItem(Lenient):
    """One input item. `message` (also a bare {role, content}), `function_call`,
    `function_call_output`, `reasoning`, `custom_tool_call(_output)`, `item_reference`."""

    type: str = "message"
    id: str | None = None
    # message
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[ContentPart] | None = None
    # function_call and custom_tool_call; their outputs
    call_id: str | None = None
    name: str | None = None
    namespace: str | None = None  # a namespaced tool's (Codex's): joined to name
    arguments: str | None = None
    input: str | None = None
    output: str | list[ContentPart] | None = None
    # reasoning
    summary: list[ContentPart] | None = None


class ToolSpec(Lenient):
    """A tool. `function` (the flat form: name, description, parameters), `custom` (free
    text, optionally a grammar), `namespace` (functions under a name); hosted ones
    (web_search, file_search, computer_use, mcp, ...) are dropped by translate."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    format: dict[str, Any] | None = None  # custom: {type: text | grammar, syntax, definition}
    tools: list[ToolSpec] | None = None  # namespace


class NamedTool(Lenient):
    type: Literal["function", "custom"]
    name: NonEmptyText
    namespace: str | None = None  # a namespaced tool's (its name then the bare one)


class AllowedTools(Lenient):
    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"] = "auto"


class TextFormat(Lenient):
    """`text.format`: text, json_object, or json_schema with its fields inline."""

    type: Literal["text", "json_object", "json_schema"]
    name: str = "answer"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    def response_format(self) -> ResponseFormat:
        """The same constraint in chat's `response_format` shape, compiled the same way."""
        schema = None
        if self.type == "json_schema":
            schema = JsonSchemaFormat.model_construct(
                name=self.name or "answer",
                description=self.description,
                schema_=self.schema_ if self.schema_ is not None else {},
                strict=self.strict,
            )
        return ResponseFormat.model_construct(type=self.type, json_schema=schema)


class TextOptions(Lenient):
    format: TextFormat | None = None


class ReasoningOptions(Lenient):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: str | None = None


class ResponsesRequest(Lenient):
    """A `/v1/responses` request body."""

    model: str | None = None
    input: str | list[InputItem] = ""
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedTool | AllowedTools | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    reasoning: ReasoningOptions | None = None
    max_output_tokens: Count | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    stop: str | StopStrings | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stream: bool = False
    store: bool = True
    metadata: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mlxspec: MlxspecOptions = Field(default_factory=MlxspecOptions)


ToolSpec.model_rebuild()
