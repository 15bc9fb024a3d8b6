"""What a request asks for (`GenerationSettings`, and the `Grammar` its text must match)
and the error for one the engine cannot serve: shared by the engine and the scheduler
whose round serves it. The grammar is compiled and enforced in grammar.py."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from mlxspec.logprobs import MAX_TOP_LOGPROBS
from mlxspec.sampling import SamplingSettings

# The JSON the grammar writes: the separators Python's json.dumps and Jinja's tojson use
# (what chat templates show a model), no other whitespace. One spelling makes the keys,
# quotes and punctuation between values forced tokens, drafted for free.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
KINDS = ("json_schema", "json_object", "regex", "lark")


class GenerationError(ValueError):
    """A request the engine cannot serve (empty prompt, too long for the context...)."""


class PromptTooLong(GenerationError):
    """A prompt that leaves no room in the context: the numbers are kept, so each API
    dialect can say them in the words its clients act on (compact, trim)."""

    def __init__(self, prompt_tokens: int, context: int):
        super().__init__(f"the prompt has {prompt_tokens} tokens; the context allows {context}")
        self.prompt_tokens, self.context = prompt_tokens, context


class NoFimTokens(GenerationError):
    """A fill-in-the-middle request to a model that has no FIM tokens: each dialect says it
    in its own shape (a 400; Ollama's `insert` capability is absent)."""

    def __init__(self, model: str):
        super().__init__(
            f"{model} has no fill-in-the-middle tokens, so it cannot complete between a "
            "prefix and a suffix; use a code model with FIM tokens (Qwen2.5-Coder, "
            "StarCoder2, DeepSeek-Coder, CodeLlama, Codestral, CodeGemma) or send no suffix"
        )
        self.model = model


class DoesNotFit(GenerationError):
    """A configuration or a request whose memory the device cannot hold: its message has
    the numbers (`batch.memory.Holdings`)."""


class GrammarError(GenerationError):
    """A grammar the engine cannot enforce: its message names what is wrong."""


@dataclass(frozen=True)
class Grammar:
    """What a request's generated text must match. `source`: the schema as JSON text
    (json_schema), the regex (regex), the Lark grammar (lark); json_object needs none.
    Plain strings, so the settings cross to other ranks as they are."""

    kind: str
    source: str = ""
    # What the request asked for, where the grammar wraps it (a JSON schema after a
    # model's reasoning block is Lark): the run record shows this. "": the kind.
    label: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GrammarError(f"unknown grammar kind '{self.kind}'; one of {', '.join(KINDS)}")

    @classmethod
    def json_schema(cls, schema: dict | str) -> Grammar:
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    def llguidance(self) -> str:
        """The grammar in llguidance's own form (not yet checked)."""
        from llguidance import LLMatcher

        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.source)
        if self.kind == "lark":
            return LLMatcher.grammar_from_lark(self.source)
        schema = self.source if self.kind == "json_schema" else '{"type": "object"}'
        try:
            return LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        except ValueError as error:
            raise GrammarError(f"the JSON schema is not valid JSON: {error}") from None

    def describe(self) -> str:
        """A short label for the run record."""
        return self.label or self.kind


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
    # Inline completion's ends (llama.cpp's n_indent, t_max_predict_ms): a later line less
    # indented than this ends the text; past this many seconds of decoding, the first
    # finished line does (a suggestion that comes late is never seen).
    min_indent: int = 0
    line_seconds: float | None = None

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
