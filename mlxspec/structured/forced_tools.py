"""Forced tool calls as a grammar: the model's own tool-call markup, around JSON that
names one of the allowed tools and holds that tool's arguments (its parameters schema).

The markup is what the output parser reads back (output_parser.AnswerFormat): Qwen3,
Hermes and the fallback format's `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`,
Llama 3.x's bare `{"name": ..., "parameters": ...}` (calls separated by `; `), Mistral's
`[TOOL_CALLS][{"name": ..., "arguments": ...}]`, gpt-oss's harmony message to
`functions.NAME` (one call: a harmony call ends the generation); Qwen3.5's XML and Gemma 4's
`call:NAME{...}` (native_calls.py). Other formats (GLM's, pythonic calls...) are refused
with their name rather than guessed at. The grammar is
llguidance's Lark with each tool's call as a `%json` schema, so a forced call is a call
the parser accepts, with arguments valid against the tool's schema (compiled leniently,
then refused by the server where the compiler ignored a keyword: unenforced.py).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mlxspec.markup.harmony import CHANNEL, CONSTRAIN, FUNCTIONS, MESSAGE
from mlxspec.markup.output_parser import JSON_TOOLS, AnswerFormat
from mlxspec.settings import JSON_OPTIONS, GrammarError
from mlxspec.structured.native_calls import GEMMA4, QWEN3_CODER, native_call_rules
from mlxspec.structured.unenforced import exclusive_one_of

MISTRAL = "mistral"
MISTRAL_ID = {"type": "string", "pattern": "^[a-zA-Z0-9]{9}$"}  # its template's call ids
# Where a schema keeps the definitions its `$ref`s point at: kept at the root of the
# call's schema, which wraps the tool's.
DEFINITIONS = ("$defs", "definitions")
LENIENT = {**JSON_OPTIONS, "lenient": True}


Spelling = Callable[[str], str]  # a marker -> its Lark form


def literal(text: str) -> str:
    """`text` as a Lark string literal: what a marker is where it is text to the tokenizer."""
    return json.dumps(text)


@dataclass(frozen=True)
class ForcedTools:
    """A request that must call a tool: `names`, the tools it may call (one: a named
    choice; all: "required" / "any"); `parallel`, whether more calls may follow the first."""

    names: tuple[str, ...]
    parallel: bool = True


def tool_calls_rules(
    form: AnswerFormat, forced: ForcedTools, spell: Spelling = literal, rule: str = "calls"
) -> str:
    """Lark rules whose `rule` is one or more calls (one where not `parallel`) in the
    format `form` reads, each to a tool in `forced.names`; GrammarError for a format
    this cannot write or a name the request's tools lack. `spell`: a marker in Lark (a
    special token's id where the tokenizer has one, see answer_grammar)."""
    tools = {tool["function"]["name"]: tool["function"] for tool in form.tools or ()}
    missing = [name for name in forced.names if name not in tools]
    if missing or not forced.names:
        raise GrammarError(f"no tool named {', '.join(map(repr, missing)) or 'at all'}")
    if form.harmony:
        return _harmony_call_rules([tools[name] for name in forced.names], spell, rule)
    if _parser_name(form) in (QWEN3_CODER, GEMMA4):
        functions = [
            {**tools[name], "parameters": _parameters(tools[name])} for name in forced.names
        ]
        markers = (form.tool_call_start or "", form.tool_call_end)
        return native_call_rules(
            _parser_name(form), functions, markers, spell, rule, forced.parallel
        )
    markup = _markup(form)
    schemas = [_call_schema(tools[name], markup) for name in forced.names]
    call_rules = [f"{rule}_{i}: %json {json.dumps(schema)}" for i, schema in enumerate(schemas)]
    call = f"{rule}_call"
    alternatives = " | ".join(f"{rule}_{i}" for i in range(len(schemas)))
    more = f" ({_spelt(markup.separator, spell)} {call})*" if forced.parallel else ""
    opening, closing = _spelt(markup.opening, spell), _spelt(markup.closing, spell)
    body = " ".join(filter(None, [opening, call + more, closing]))
    return "\n".join([f"{rule}: {body}", f"{call}: {alternatives}", *call_rules])


@dataclass(frozen=True)
class CallMarkup:
    """How a format writes its calls: the markup (markers and text, in order) before
    them, between two and after them; the key of a call's arguments; the properties a
    call may have after them."""

    opening: tuple[str, ...]
    separator: tuple[str, ...]
    closing: tuple[str, ...]
    arguments_key: str = "arguments"
    more: dict[str, Any] = field(default_factory=dict)


def _markup(form: AnswerFormat) -> CallMarkup:
    if form.calls_open_answer:  # Llama 3.x: the answer is its calls
        return CallMarkup((), ("; ",), (), arguments_key="parameters")
    parser = _parser_name(form)
    start, end = form.tool_call_start or "", form.tool_call_end
    if parser == JSON_TOOLS:
        return CallMarkup((start, "\n"), ("\n", end, "\n", start, "\n"), ("\n", end))
    if parser == MISTRAL:  # a JSON list after the marker, to the end of the answer
        return CallMarkup((start, "["), (", ",), ("]",), more={"id": MISTRAL_ID})
    raise GrammarError(
        f"cannot force a tool call in this model's tool-call format ({parser or 'unknown'}); "
        "forced calls support the Hermes/Qwen <tool_call> JSON, Llama 3.x, Mistral, "
        "gpt-oss harmony, Qwen3.5 XML and Gemma 4 formats"
    )


def _parser_name(form: AnswerFormat) -> str:
    """The mlx-lm tool parser's module name ("" for none)."""
    module = getattr(form.tool_parser, "__module__", "") or ""
    return module.rsplit(".", 1)[-1]


def _harmony_call_rules(functions: list[dict[str, Any]], spell: Spelling, rule: str) -> str:
    """Harmony's call: a commentary message to one of `functions`, its body the arguments
    (the end token, `<|call|>`, is the generation's end, left to the engine)."""
    channel, message, constrain = spell(CHANNEL), spell(MESSAGE), spell(CONSTRAIN)
    alternatives, rules = [], []
    for i, function in enumerate(functions):
        recipient = literal(f"commentary to={FUNCTIONS}{function['name']} ")
        arguments = json.dumps({"x-guidance": LENIENT, **_parameters(function)})
        rules.append(
            f'{rule}_{i}: {channel} {recipient} {constrain} "json" {message} %json {arguments}'
        )
        alternatives.append(f"{rule}_{i}")
    return "\n".join([f"{rule}: {' | '.join(alternatives)}", *rules])


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters schema, a copy, checked, typed as an object where it has
    properties, its exclusive `oneOf`s made `anyOf`s (unenforced.py)."""
    parameters = exclusive_one_of(copy.deepcopy(function.get("parameters") or {"type": "object"}))
    if not isinstance(parameters, dict):
        raise GrammarError(f"the parameters of tool {function['name']!r} are not a JSON schema")
    if parameters.get("type") is None and "properties" in parameters:
        parameters["type"] = "object"
    return parameters


def _call_schema(function: dict[str, Any], markup: CallMarkup) -> dict[str, Any]:
    """One call to `function` as a JSON schema: its name, then its arguments, in the
    JSON spelling of the house (grammar.JSON_OPTIONS), leniently compiled."""
    parameters = _parameters(function)
    definitions = {key: parameters.pop(key) for key in DEFINITIONS if key in parameters}
    return {
        "x-guidance": LENIENT,
        "type": "object",
        "properties": {
            "name": {"const": function["name"]},
            markup.arguments_key: parameters,
            **markup.more,
        },
        "required": ["name", markup.arguments_key],
        "additionalProperties": False,
        **definitions,
    }


def _spelt(markup: tuple[str, ...], spell: Spelling) -> str:
    return " ".join(spell(text) if text.strip() else literal(text) for text in markup if text)
