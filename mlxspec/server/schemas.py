"""Request bodies of the OpenAI-compatible endpoints, as pydantic models.

Strict types: "5" is not a number and 1 is not a boolean, so a client bug is reported
rather than guessed at. Fields of OpenAI's API that mlxspec does not use (user,
...) are ignored so that stock clients work; the `mlxspec` extension object is
ours, so a misspelt key in it is refused.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
)

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
        logprobs); each dialect asks for them its own way."""
        raise NotImplementedError


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def for_template(self) -> dict[str, str]:
        """The plain {role, content} a chat template expects."""
        role = "system" if self.role == "developer" else self.role  # OpenAI's newer name
        if isinstance(self.content, str):
            return {"role": role, "content": self.content}
        return {"role": role, "content": "".join(part.text for part in self.content)}


class ChatRequest(GenerationRequest):
    messages: Annotated[list[Message], Field(min_length=1)]
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

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
