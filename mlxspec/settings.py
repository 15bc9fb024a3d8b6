"""What a request asks for (`GenerationSettings`) and the error for one the engine
cannot serve: shared by the engine and the scheduler whose round serves it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from mlxspec.grammar import Grammar
from mlxspec.logprobs import MAX_TOP_LOGPROBS
from mlxspec.sampling import SamplingSettings


class GenerationError(ValueError):
    """A request the engine cannot serve (empty prompt, too long for the context...)."""


@dataclass
class GenerationSettings:
    max_tokens: int = 256
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    stop: Sequence[str] = ()
    k: int | None = None  # None: adaptive; an int: fixed draft length (0 = plain)
    context: int = 8192  # prompt + completion tokens the model may see
    tree: bool = False  # verify a tree of candidates per round instead of one line
    tree_nodes: int = 32  # most draft nodes a tree may have (its verify cost prunes it)
    history: bool = True  # read and feed the model's history of earlier requests
    # Report each emitted token's log-probability with this many likeliest alternatives
    # (0..MAX_TOP_LOGPROBS); None: no logprobs, nothing computed.
    logprobs: int | None = None
    # What the generated text must match (structured output); None: anything.
    grammar: Grammar | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise GenerationError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.k is not None and self.k < 0:
            raise GenerationError(f"k must be >= 0, got {self.k}")
        if self.tree_nodes < 1:
            raise GenerationError(f"tree_nodes must be >= 1, got {self.tree_nodes}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise GenerationError(
                f"logprobs must be in 0..{MAX_TOP_LOGPROBS} alternatives, got {self.logprobs}"
            )
