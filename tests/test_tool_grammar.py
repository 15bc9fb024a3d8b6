"""Forced tool calls and structured answers as grammars, checked with llguidance's matcher
on real chat templates: the call each template writes is accepted, a wrong name or
argument is not, and every answer the grammar allows is one the output parser reads as
calls with valid arguments (random walks through the grammar's masks)."""

from __future__ import annotations

import json
import random

import pytest
from mlx_lm.tool_parsers import glm47
from tiny_models import EOS, byte_tokenizer
from tool_examples import ASK, TEMPLATES

from mlxspec.markup.chat_template import render_chat
from mlxspec.markup.conversation import Conversation
from mlxspec.markup.output_parser import AnswerFormat, OutputParser, answer_format
from mlxspec.settings import GenerationError
from mlxspec.structured.answer import AnswerConstraint, answer_grammar, grammar_problem
from mlxspec.structured.forced_tools import ForcedTools, tool_calls_rules
from mlxspec.structured.grammar import Grammar, GrammarError, compile_grammar

VOCAB = 257
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "unit": {"enum": ["C", "F"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"$ref": "#/$defs/zone"}},
            "required": ["zone"],
            "$defs": {"zone": {"enum": ["UTC", "CET"]}},
        },
    },
}
TOOLS = [WEATHER, TIME]
CALL = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}
# template -> what ends the assistant's turn after its calls (left out of the grammar)
TEMPLATES_WITH_CALLS = {
    "qwen3.jinja": "<|im_end|>",
    "hermes3.jinja": "<|im_end|>",
    "smollm2.jinja": "<|im_end|>",
    "llama3.3.jinja": "<|eot_id|>",
    "mistral-nemo.jinja": EOS,
}


def tokenizer_with(template: str):
    tokenizer = byte_tokenizer()
    tokenizer._tokenizer.chat_template = (TEMPLATES / template).read_text()
    return tokenizer


def forced(template: str, names=("get_weather",), parallel=True, **template_kwargs):
    tokenizer = tokenizer_with(template)
    conversation = Conversation(ASK, TOOLS, template_kwargs)
    grammar = answer_grammar(
        tokenizer, conversation, AnswerConstraint(tools=ForcedTools(names, parallel))
    )
    return tokenizer, conversation, grammar


def matched(grammar: Grammar, tokenizer, text: str) -> str:
    """How far the grammar takes `text`: "complete", "incomplete", or where it refused."""
    matcher = compile_grammar(grammar, tokenizer, VOCAB)
    for at, token in enumerate(tokenizer.encode(text, add_special_tokens=False)):
        if not matcher.consume_token(token):
            return f"refused after {tokenizer.decode(tokenizer.encode(text)[:at])!r}"
    return "complete" if matcher.is_accepting() else "incomplete"


def templates_own_call(tokenizer, conversation: Conversation, end: str) -> str:
    """The assistant turn the template writes for CALL, after the generation prompt, its
    end-of-turn markup cut."""
    call = {"id": "call00001", "type": "function", "function": CALL}
    asked = [*conversation.messages, {"role": "assistant", "content": "", "tool_calls": [call]}]
    whole = render_chat(tokenizer, Conversation(asked, conversation.tools), generation_prompt=False)
    prompt = render_chat(tokenizer, conversation)
    assert whole.startswith(prompt)
    turn = whole[len(prompt) :].strip()
    assert turn.endswith(end), turn
    return turn[: -len(end)].strip()


@pytest.mark.parametrize("template", TEMPLATES_WITH_CALLS)
def test_the_call_each_template_writes_is_what_the_grammar_accepts(template):
    tokenizer, conversation, grammar = forced(template, enable_thinking=False)
    assert grammar.describe() == "tool_call"  # the run record says what was asked
    call = templates_own_call(tokenizer, conversation, TEMPLATES_WITH_CALLS[template])
    assert matched(grammar, tokenizer, call) == "complete", (call, grammar.source)
    wrong_name = call.replace("get_weather", "get_wether")
    assert matched(grammar, tokenizer, wrong_name).startswith("refused")
    wrong_argument = call.replace('"C"', '"K"')
    assert matched(grammar, tokenizer, wrong_argument).startswith("refused")


def random_answer(
    grammar: Grammar, tokenizer, rng: random.Random, opening: str, limit: int = 400
) -> str:
    """A walk through the grammar after `opening` (reasoning is free text, where a random
    walk would never end): a random allowed token each step, leaning towards closing
    quotes and brackets so that strings end, until the grammar may end."""
    matcher = compile_grammar(grammar, tokenizer, VOCAB)
    closing = {tokenizer.encode(c)[0] for c in '"}]<'}
    produced: list[int] = tokenizer.encode(opening)
    assert matcher.consume_tokens(produced)
    while len(produced) < limit and not matcher.is_stopped():
        if matcher.is_accepting() and rng.random() < 0.8:
            return tokenizer.decode(produced)
        bits = bytes(matcher.compute_bitmask())
        allowed = [t for t in range(VOCAB - 1) if bits[t // 8] >> (t % 8) & 1]
        leaning = [t for t in allowed if t in closing]
        token = rng.choice(leaning if leaning and rng.random() < 0.5 else allowed)
        assert matcher.consume_token(token)
        produced.append(token)
    assert matcher.is_accepting(), tokenizer.decode(produced)
    return tokenizer.decode(produced)


def valid_arguments(name: str, arguments: dict) -> bool:
    if name == "get_weather":
        return (
            set(arguments) == {"city", "unit"}
            and isinstance(arguments["city"], str)
            and len(arguments["city"]) <= 8
            and arguments["unit"] in ("C", "F")
        )
    return name == "get_time" and arguments["zone"] in ("UTC", "CET")  # more are allowed


@pytest.mark.parametrize(
    "template, names, opening",
    [
        ("qwen3.jinja", ("get_weather", "get_time"), "<think>\nHm.\n</think>\n\n"),
        ("qwen3.jinja", ("get_time",), "<tool_call>"),  # else it may think at length
        ("deepseek-r1-distill.jinja", ("get_weather", "get_time"), "Hm.\n</think>\n\n"),
        ("smollm2.jinja", ("get_weather", "get_time"), ""),
        ("llama3.3.jinja", ("get_weather", "get_time"), ""),
        ("mistral-nemo.jinja", ("get_weather",), ""),
    ],
)
def test_whatever_the_grammar_allows_parses_as_calls_to_the_named_tools(template, names, opening):
    tokenizer, conversation, grammar = forced(template, names)
    form = answer_format(tokenizer, conversation)
    rng = random.Random(template)
    for _ in range(6):
        answer = random_answer(grammar, tokenizer, rng, opening)
        parser = OutputParser(form)
        parser.feed(answer)
        parser.finish()
        parsed = parser.answer
        assert parsed.tool_calls and not parsed.text.strip(), answer
        thought, ended, _ = opening.partition("</think>")
        assert parsed.reasoning == (thought.removeprefix("<think>") if ended else "")
        for call in parsed.tool_calls:
            assert call.name in names
            assert valid_arguments(call.name, json.loads(call.arguments)), answer


def test_a_thinking_model_may_reason_before_the_call_and_the_reasoning_stays_apart():
    tokenizer, conversation, grammar = forced("qwen3.jinja", enable_thinking=True)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "F"}}'
    answer = f"<think>\nA </thin> is no end.\n</think>\n\n{call}\n</tool_call>"
    assert matched(grammar, tokenizer, answer) == "complete"
    assert matched(grammar, tokenizer, "Sure.\n" + call).startswith("refused")
    parser = OutputParser(answer_format(tokenizer, conversation))
    parser.feed(answer)
    parser.finish()
    assert parser.answer.reasoning == "\nA </thin> is no end.\n"
    assert [call.name for call in parser.answer.tool_calls] == ["get_weather"]


def test_a_prompt_that_opened_the_reasoning_makes_the_grammar_start_inside_it():
    tokenizer, _, grammar = forced("deepseek-r1-distill.jinja")
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}'
    assert matched(grammar, tokenizer, f"Oslo, then.\n</think>\n\n{call}\n</tool_call>") == (
        "complete"
    )
    assert matched(grammar, tokenizer, f"{call}\n</tool_call>") == "incomplete"  # still thinking


def test_one_call_only_where_parallel_calls_are_off():
    tokenizer, _, grammar = forced("qwen3.jinja", parallel=False, enable_thinking=False)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}'
    matcher = compile_grammar(grammar, tokenizer, VOCAB)
    assert matcher.consume_tokens(tokenizer.encode(f"{call}\n</tool_call>"))
    assert matcher.is_stopped()  # complete: nothing may follow, the request ends here


def test_a_schema_without_thinking_markers_is_the_requests_grammar_unchanged():
    schema = Grammar.json_schema({"type": "object"})
    tokenizer = tokenizer_with("smollm2.jinja")
    constraint = AnswerConstraint(grammar=schema)
    assert answer_grammar(tokenizer, Conversation(ASK), constraint) is schema
    assert answer_grammar(tokenizer, "a raw prompt", constraint) is schema


@pytest.mark.parametrize("pattern", ["a/b[0-9]+", r"a\/b[0-9]+"])
def test_a_regex_after_reasoning_keeps_its_slashes(pattern):
    tokenizer = tokenizer_with("qwen3.jinja")
    constraint = AnswerConstraint(grammar=Grammar("regex", pattern))
    grammar = answer_grammar(tokenizer, Conversation(ASK), constraint)
    assert matched(grammar, tokenizer, "<think>\nok\n</think>\n\na/b12") == "complete"


def test_formats_it_cannot_write_and_unknown_names_are_refused_with_a_reason():
    with pytest.raises(GrammarError, match="no tool named 'get_date'"):
        forced("qwen3.jinja", ("get_date",))
    glm = AnswerFormat(
        tool_call_start="<tool_call>",
        tool_call_end="</tool_call>",
        tool_parser=glm47.parse_tool_call,
        tools=TOOLS,
    )
    with pytest.raises(GrammarError, match=r"tool-call format \(glm47\)"):
        tool_calls_rules(glm, ForcedTools(("get_weather",)))


def test_schema_problems_are_one_line_naming_the_keyword():
    unique = {"type": "array", "uniqueItems": True}
    assert grammar_problem(Grammar.json_schema(unique)) == (
        'cannot enforce the keyword(s) "uniqueItems"'
    )
    uuid = {"type": "string", "format": "uuid4x"}
    assert grammar_problem(Grammar.json_schema(uuid)) == 'cannot enforce "format": "uuid4x"'
    # lenient: an unknown format is an annotation, ignored; a keyword that asserts is not
    lenient = {"x-guidance": {"lenient": True}}
    assert grammar_problem(Grammar.json_schema({**uuid, **lenient})) is None
    assert grammar_problem(Grammar.json_schema({**unique, **lenient})) == (
        'cannot enforce the keyword(s) "uniqueItems"'
    )
    assert "\n" not in grammar_problem(Grammar("regex", "a(b"))


@pytest.mark.parametrize("template", ["qwen3.5.jinja", "gemma4.jinja"])
@pytest.mark.parametrize(
    "parameters",
    [
        {"type": "object", "properties": {"city": "string"}},
        {"type": "object", "properties": {"city": {"type": "string", "minLength": "x"}}},
        {"type": "object", "properties": ["city"]},
    ],
    ids=["a-property-as-a-string", "a-length-as-text", "properties-as-a-list"],
)
def test_a_malformed_tool_schema_is_a_grammar_error_naming_the_tool(template, parameters):
    """A client's mistake is a 400 (a GenerationError: the grammar's, or the template's own
    refusal), not the AttributeError or ValueError the native call grammars raised (a 500)."""
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": parameters}}
    conversation = Conversation(ASK, [tool])
    says = "the parameters of tool 'get_weather'|the model's chat template refused"
    with pytest.raises(GenerationError, match=says):
        answer_grammar(
            tokenizer_with(template),
            conversation,
            AnswerConstraint(tools=ForcedTools(("get_weather",))),
        )


@pytest.mark.parametrize("template", ["qwen3.jinja", "hermes3.jinja"])
def test_parallel_calls_as_the_template_writes_them_are_what_the_grammar_accepts(template):
    """Two calls at once, as the template renders them (a line between them), match the
    forced grammar: the model is forced into its own markup, not a spelling near it."""
    tokenizer, conversation, grammar = forced(template, enable_thinking=False)
    other = {"name": "get_weather", "arguments": {"city": "Rome", "unit": "F"}}
    calls = [
        {"id": f"call0000{i}", "type": "function", "function": call}
        for i, call in enumerate([CALL, other])
    ]
    asked = [*conversation.messages, {"role": "assistant", "content": "", "tool_calls": calls}]
    whole = render_chat(tokenizer, Conversation(asked, TOOLS), generation_prompt=False)
    turn = whole[len(render_chat(tokenizer, conversation)) :].strip()
    turn = turn[: -len(TEMPLATES_WITH_CALLS[template])].strip()
    assert turn.count("<tool_call>") == 2, turn
    assert matched(grammar, tokenizer, turn) == "complete", (turn, grammar.source)


def test_a_tool_whose_schema_has_properties_but_no_type_takes_an_object():
    """A schema of properties alone (clients send them) types nothing in JSON Schema;
    a forced call's arguments must still be an object, which the parser reads as one."""
    untyped = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {"properties": {"x": {"type": "integer"}}, "required": ["x"]},
        },
    }
    tokenizer = tokenizer_with("qwen3.jinja")
    conversation = Conversation(ASK, [untyped], {"enable_thinking": False})
    grammar = answer_grammar(tokenizer, conversation, AnswerConstraint(tools=ForcedTools(("f",))))
    call = '<tool_call>\n{{"name": "f", "arguments": {}}}\n</tool_call>'
    assert matched(grammar, tokenizer, call.format('{"x": 1}')) == "complete"
    assert matched(grammar, tokenizer, call.format("5")).startswith("refused")
