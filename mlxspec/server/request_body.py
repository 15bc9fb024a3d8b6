"""What every dialect's request is read into (`GenerationRequest`, in OpenAI's field names, the
server's lingua franca), as pydantic models: the sampling fields, stop strings, the answer's
format and the `mlxspec` extension object.

Strict types: "5" is not a number and 1 is not a boolean, so a client bug is reported
rather than guessed at. Fields of OpenAI's API that mlxspec does not use (user,
...) are ignored so that stock clients work; the `mlxspec` extension object is
ours, so a misspelt key in it is refused.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from mlxspec.sampling import MAX_CONTEXT_SIZE
from mlxspec.server.errors import ApiError
from mlxspec.structured.answer import AnswerConstraint, grammar_problem, tool_schema_problem
from mlxspec.structured.grammar import Grammar
from mlxspec.structured.unenforced import exclusive_one_of

NonEmptyText = Annotated[str, Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0)]
StopStrings = Annotated[list[str], Field(max_length=4)]
Count = Annotated[int, Field(ge=1)]
ContextSize = Annotated[int, Field(ge=1, le=MAX_CONTEXT_SIZE)]

log = logging.getLogger("mlxspec.server")


class Lenient(BaseModel):
    """Strict types, but a field this server does not know is ignored, never refused: a
    newer client adds fields (Claude Code's `context_management`, Codex's
    `client_metadata`), and a request that is valid for its dialect must still be served.
    What was ignored goes to the debug log (`serve --log-level debug`)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _log_ignored(cls, data: Any) -> Any:
        if isinstance(data, dict) and log.isEnabledFor(logging.DEBUG):
            aliases = {info.alias for info in cls.model_fields.values() if info.alias}
            known = set(cls.model_fields) | aliases
            ignored = sorted(key for key in data if key not in known)
            if ignored:
                log.debug("%s: ignored fields %s", cls.__name__, ", ".join(ignored))
        return data


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
        None,
        description="true: an unknown format is a 400 too; else ignored (a keyword that "
        "asserts, and cannot be enforced, is a 400 either way).",
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

    def grammar(self, param: str = "response_format.json_schema.schema") -> Grammar | None:
        """The grammar the answer must match (None: text), or ApiError (400) naming what
        of the schema cannot be enforced. Not strict: compiled leniently, so an unknown
        format is ignored (an annotation); a keyword that asserts is still refused."""
        if self.type == "text":
            return None
        if self.json_schema is None:
            return Grammar("json_object")
        schema, strict = exclusive_one_of(self.json_schema.schema_), bool(self.json_schema.strict)
        guidance = schema.get("x-guidance", {})
        if not isinstance(guidance, dict):
            param += ".x-guidance"
            raise ApiError(400, f"{param}: must be an object", code="invalid_value", param=param)
        lenient = {**schema, "x-guidance": {**guidance, "lenient": True}}
        grammar = Grammar.json_schema(schema if strict else lenient)
        problem = grammar_problem(grammar)
        if problem is not None:
            if strict and grammar_problem(Grammar.json_schema(lenient)) is None:
                problem += "; remove it, or set strict to false to have it ignored"
            raise ApiError(400, f"{param}: {problem}", code="invalid_value", param=param)
        return grammar


class FunctionSpec(BaseModel):
    """A tool the model may call, in OpenAI's function form (Ollama's too)."""

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


def check_forced_schemas(schemas: list[tuple[str, dict[str, Any] | None]]) -> None:
    """ApiError (400) naming the field of the first forced tool whose parameters schema
    cannot be compiled; `schemas`: (the field, in the dialect's names; its schema or None).
    Checked here, as the body is read, rather than where the grammar compiles (on the
    generation thread, where a failure would read as the server's)."""
    for param, schema in schemas:
        problem = None if schema is None else tool_schema_problem(schema)
        if problem is not None:
            raise ApiError(400, f"{param}: {problem}", code="invalid_value", param=param)


class GenerationRequest(Lenient):
    """What chat and text completions share."""

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


def effort_kwargs(effort: str | None, defaults: dict[str, Any]) -> dict[str, Any]:
    """The model's template arguments with a request's reasoning effort: gpt-oss's template
    reads `reasoning_effort` (low, medium, high); "none" turns a thinking switch off
    (Qwen3's `enable_thinking`); templates ignore what they do not read."""
    kwargs = dict(defaults)
    if effort == "none":
        kwargs["enable_thinking"] = False
    elif effort is not None:
        kwargs["reasoning_effort"] = {"minimal": "low", "xhigh": "high", "max": "high"}.get(
            effort, effort
        )
    return kwargs
