"""A request's structured output as the grammar the engine enforces: the answer after the
model's reasoning, in the model's own markup.

An API request asks for its answer's shape before the model is known (a JSON schema, a
regex, a forced tool call: `AnswerConstraint`); the grammar is built once the tokenizer is
at hand (`answer_grammar`), because the markup is the model's:

- reasoning stays free: a model that thinks first (the prompt opened the block, as
  DeepSeek-R1's does, or the template lets the answer open one, as Qwen3's) may reason
  before the constrained answer; the grammar allows any text up to the end marker, then
  whitespace, as the output parser reads it. Where the template has no thinking markers
  the grammar is the request's own, unchanged.
- a forced tool call is written in the format the output parser reads back
  (tool_grammar.py).
- gpt-oss's harmony: an optional analysis message, then the answer as a `final` message
  (a forced call: a commentary message to the tool, tool_grammar.py).

A marker that is a special token to the tokenizer (Mistral's `[TOOL_CALLS]`) is the token
in the grammar (`<[id]>`), since llguidance never matches special tokens as text.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass

from mlxspec.markup.harmony import CHANNEL, END, MESSAGE, START
from mlxspec.markup.output_parser import AnswerFormat, answer_format
from mlxspec.settings import JSON_OPTIONS, Grammar, GrammarError
from mlxspec.structured.forced_tools import (
    LENIENT,
    ForcedTools,
    Spelling,
    literal,
    tool_calls_rules,
)
from mlxspec.structured.grammar import CACHED_GRAMMARS, error_line
from mlxspec.structured.native_calls import slashes
from mlxspec.structured.unenforced import unenforced


@dataclass(frozen=True)
class AnswerConstraint:
    """What a request's answer must be, as asked: a grammar (`response_format`) or forced
    tool calls; `param`, the request's field that asked (errors name it)."""

    grammar: Grammar | None = None
    tools: ForcedTools | None = None
    param: str = "response_format"


def answer_grammar(tokenizer, prompt: object, constraint: AnswerConstraint) -> Grammar:
    """The grammar for the answer to `prompt` (a Conversation, or a raw prompt answered
    as plain text); GrammarError, with a reason, where it cannot be written."""
    form = answer_format(tokenizer, prompt)
    spell = _spelling(tokenizer)
    reasoning = _harmony_reasoning(spell) if form.harmony else _reasoning_rules(form, spell)
    if constraint.tools is not None:
        answer = tool_calls_rules(form, constraint.tools, spell, rule="answer")
    elif constraint.grammar is None:
        raise GrammarError("nothing to constrain the answer to")
    elif not reasoning:
        return constraint.grammar
    elif form.harmony:  # the final channel's message
        final = f'answer: {spell(CHANNEL)} "final" {spell(MESSAGE)} final_text'
        answer = f"{final}\n{_answer_rule(constraint.grammar, 'final_text')}"
    else:
        answer = _answer_rule(constraint.grammar)
    start = "start: thought? answer" if reasoning else "start: answer"
    if form.starts_in_reasoning:
        start = "start: thought answer"
    label = "tool_call" if constraint.tools is not None else constraint.grammar.describe()
    lark = "\n".join(filter(None, [start, reasoning, answer])) + "\n"
    return Grammar("lark", lark, label=label)


def json_spelling(schema: dict) -> dict:
    """`schema` with the house JSON spelling (grammar.JSON_OPTIONS) in its `x-guidance`
    (over its own, whose other options, `lenient` say, stay)."""
    return {**schema, "x-guidance": {**schema.get("x-guidance", {}), **JSON_OPTIONS}}


@functools.lru_cache(maxsize=CACHED_GRAMMARS)
def grammar_problem(grammar: Grammar) -> str | None:
    """Why llguidance cannot compile `grammar` (one line), or None: checked without a
    tokenizer, so a request is refused before it waits for its model. Kept per grammar,
    as compiled grammars are: an agent sends the same schema again and again, and a large
    one takes a second to check. A keyword a lenient schema would have ignored is a
    problem too (unenforced.py): an answer must never break its schema."""
    from llguidance import LLMatcher

    try:
        failed, messages = LLMatcher.validate_grammar_with_warnings(grammar.llguidance())
    except (GrammarError, ValueError) as err:
        return str(err).strip().splitlines()[0]
    return error_line(messages[0]) if failed else unenforced(messages)


def tool_schema_problem(parameters: dict) -> str | None:
    """Why a forced tool's `parameters` cannot be compiled (one line), or None: checked as
    the forced call compiles them (leniently, see forced_tools.py), but before the request
    waits for its model, so the client hears which tool's schema is wrong."""
    return grammar_problem(Grammar.json_schema({"x-guidance": LENIENT, **parameters}))


def _reasoning_rules(form: AnswerFormat, spell: Spelling) -> str:
    """Lark rules for the reasoning the answer may open with ("" for none): `thought`,
    everything up to and including the end marker, then whitespace."""
    if form.think_end is None:
        return ""
    end = spell(form.think_end)
    opening = "" if form.starts_in_reasoning else f"{spell(form.think_start)} "
    if end.startswith("<["):  # a special token: text can never be it, so no laziness
        thought = f"thought: {opening}/(?s:.*)/ {end} GAP?"
    else:  # lazy: the reasoning ends at the first end marker
        thought = (
            f"thought: {opening}thought_text GAP?\n"
            f"thought_text[lazy]: /(?s:.*){_escape(form.think_end)}/"
        )
    return f"{thought}\nGAP: /[ \\t\\r\\n]+/"


def _harmony_reasoning(spell: Spelling) -> str:
    """Lark rules for harmony's analysis message (`thought`) and the next one's start."""
    opening = f'{spell(CHANNEL)} "analysis" {spell(MESSAGE)}'
    end, next_message = spell(END), f'{spell(START)} "assistant"'
    if end.startswith("<["):  # a special token: text can never be it, so no laziness
        return f"thought: {opening} /(?s:.*)/ {end} {next_message}"
    return (
        f"thought: {opening} thought_text {next_message}\n"
        f"thought_text[lazy]: /(?s:.*){_escape(END)}/"
    )


def _answer_rule(grammar: Grammar, rule: str = "answer") -> str:
    """The request's grammar as the Lark rule `rule`."""
    if grammar.kind == "regex":
        return f"{rule}: /{slashes(grammar.source)}/"
    if grammar.kind == "json_object":
        return f"{rule}: %json {json.dumps(json_spelling({'type': 'object'}))}"
    if grammar.kind == "json_schema":
        try:
            schema = json.loads(grammar.source)
        except ValueError as err:
            raise GrammarError(f"the JSON schema is not valid JSON: {err}") from None
        return f"{rule}: %json {json.dumps(json_spelling(schema))}"
    raise GrammarError("a Lark grammar cannot follow this model's reasoning block")


def _escape(text: str) -> str:
    """`text` as a regex between Lark's slashes."""
    return slashes(re.escape(text))


def _spelling(tokenizer) -> Spelling:
    """A marker as the grammar writes it: the special token it is, else its text."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    added = getattr(hf, "added_tokens_decoder", {}) or {}
    special = {token.content: token_id for token_id, token in added.items() if token.special}
    return lambda text: f"<[{special[text]}]>" if text in special else literal(text)
