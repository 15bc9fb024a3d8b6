"""Request bodies of llama.cpp's `/infill` and `/completion`, over the fields every
dialect shares (`server.request_body`): llama.cpp's names mapped to OpenAI's.

Fields llama.cpp takes that change nothing here are accepted and ignored, so its clients
work unchanged: `cache_prompt` (the prompt cache is always on), `samplers` (the order of
top-k, top-p and temperature is fixed), `t_max_prompt_ms` (a prompt is filled whole),
`id_slot` (read: a newer request of the same slot cancels the older one).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from mlxspec.markup.fim import ExtraFile, Infill
from mlxspec.server.errors import ApiError
from mlxspec.server.request_body import GenerationRequest, TokenId

MAX_STOP_STRINGS = 32
# llama.cpp's default n_predict is -1 (until the context is full); here the model's default
# max_tokens applies then, as for a request of any dialect that names none.
UNLIMITED = -1


class ExtraChunk(BaseModel):
    """One entry of `input_extra`: a file's name and (some of) its text."""

    model_config = ConfigDict(strict=True, extra="ignore")

    filename: str = "tmp"  # llama.cpp's default name
    text: str = ""


class LlamaCppRequest(GenerationRequest):
    """`/completion`'s body; `/infill` adds the hole's parts (InfillRequest)."""

    prompt: str | Annotated[list[TokenId], Field(min_length=1)] = ""
    # Continue sends a FIM model's nine markers as stop strings; Tabby a random u64 seed.
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: int | None = Field(None, ge=0, description="Any size (a u64 from Tabby).")
    n_predict: int = Field(UNLIMITED, ge=UNLIMITED, description="-1: the model's default.")
    top_k: int | None = Field(None, ge=0)
    n_indent: int = Field(0, ge=0, description="End at a line indented less than this.")
    t_max_predict_ms: int = Field(0, ge=0, description="After this, end at a line's end.")
    response_fields: list[str] | None = Field(
        None, description="Only these fields (a/b: b of a), at the top level."
    )
    id_slot: int = Field(-1, description="A newer request of the same slot cancels this one.")
    n_cmpl: int | None = Field(None, ge=1, le=8, description="Completions to make (n).")
    n_probs: int = Field(0, ge=0, description="Not supported: only 0.")
    cache_prompt: bool = True
    samplers: list[str] | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_probs(cls, data: Any) -> Any:
        """`n_probs` refused rather than ignored: the answer would lack what was asked."""
        if isinstance(data, dict) and isinstance(data.get("n_probs"), int) and data["n_probs"]:
            raise ValueError("n_probs: token probabilities are not served here; send 0")
        return data

    @property
    def completions(self) -> int:
        return self.n_cmpl or self.n or 1

    @property
    def warm_up(self) -> bool:
        """n_predict 0: take the prompt into the cache and answer nothing (llama.vim sends
        its extra context so, ahead of the next completion)."""
        return self.n_predict == 0

    def granted_tokens(self) -> int | None:
        """max_tokens as OpenAI's fields carry it (None: the model's default)."""
        if self.n_predict == UNLIMITED:
            return None
        return max(1, self.n_predict)  # 0 still makes one token, which is not answered

    def prompt_input(self) -> str | list[int] | Infill:
        if not self.prompt:
            raise ApiError(400, "prompt: must not be empty", code="invalid_value", param="prompt")
        return self.prompt


class InfillRequest(LlamaCppRequest):
    """`/infill`: the text before and after the cursor, other files, and `prompt` (the
    part of the line typed since the prefix ends), as llama.cpp's format_prompt_infill."""

    input_prefix: str = ""
    input_suffix: str = Field(description="The text after the hole (may be empty).")
    input_extra: list[ExtraChunk] = Field(default_factory=list)
    prompt: str = ""

    def prompt_input(self) -> Infill:
        extra = tuple(ExtraFile(chunk.filename, chunk.text) for chunk in self.input_extra)
        return Infill(self.input_prefix, self.input_suffix, extra, self.prompt)
