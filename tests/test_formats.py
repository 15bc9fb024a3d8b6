"""The formats of the models a Mac user runs today, read off their real chat templates
(templates/README.md): gpt-oss's harmony channels, Qwen3.5's thinking and XML tool calls,
Gemma 4's thought channel and `call:` tool calls. Each answer, cut anywhere, gives the
same parts; text streams as soon as it cannot be a marker."""

from __future__ import annotations

import pytest
from test_output_parser import calls_of, form_of, joined, tokenizer_with
from test_tool_grammar import forced, matched
from tool_examples import ASK, WEATHER

from mlxspec.events import Accepted, Bonus
from mlxspec.markup.chat_template import render_chat
from mlxspec.markup.conversation import AnswerText, Conversation, ParsedAnswer, ReasoningText
from mlxspec.markup.display import PieceReader
from mlxspec.markup.output_parser import answer_format, answer_parser, reasoning_tokens
from mlxspec.structured.answer import AnswerConstraint, answer_grammar
from mlxspec.structured.forced_tools import ForcedTools
from mlxspec.structured.grammar import Grammar

PARIS = [("get_weather", {"city": "Paris"})]
HARMONY_CALL = (
    "<|channel|>analysis<|message|>Need the weather tool.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris"}<|call|>'
)
HARMONY_ANSWER = (
    "<|channel|>analysis<|message|>The tool said 18C.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>It is 18C <in> Paris.<|return|>"
)
QWEN35_CALL = (  # the prompt opened <think> (thinking on, Qwen3.5's default)
    "The user wants Paris.\n</think>\n\nLet me check.\n\n<tool_call>\n<function=get_weather>\n"
    "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
)
GEMMA4_CALL = (
    '<|channel>thought\nNeed the tool.<channel|><|tool_call>call:get_weather{city:<|"|>Paris<|"|>}'
    "<tool_call|>"
)


def parse(form, pieces: list[str]):
    parser = answer_parser(form)
    parts = [part for piece in pieces for part in parser.feed(piece)]
    return parts + parser.finish(), parser


def cuts(text: str) -> list[list[str]]:
    """The text whole, a character at a time, and cut in two at every point."""
    return [[text], list(text)] + [[text[:i], text[i:]] for i in range(1, len(text))]


@pytest.mark.parametrize(
    "template, kwargs, answer, expected",
    [
        ("gpt-oss.jinja", {}, HARMONY_CALL, ("Need the weather tool.", "", PARIS)),
        ("gpt-oss.jinja", {}, HARMONY_ANSWER, ("The tool said 18C.", "It is 18C <in> Paris.", [])),
        (
            "qwen3.5.jinja",
            {"enable_thinking": True},
            QWEN35_CALL,
            ("The user wants Paris.\n", "Let me check.\n\n", PARIS),
        ),
        ("gemma4.jinja", {"enable_thinking": True}, GEMMA4_CALL, ("\nNeed the tool.", "", PARIS)),
    ],
    ids=["harmony-call", "harmony-answer", "qwen3.5-call", "gemma4-call"],
)
def test_each_format_cut_anywhere_gives_its_reasoning_text_and_calls(
    template, kwargs, answer, expected
):
    form = form_of(template, **kwargs)
    for pieces in cuts(answer):
        parts, parser = parse(form, pieces)
        found = (joined(parts, ReasoningText), joined(parts, AnswerText), calls_of(parts))
        assert found == expected, pieces
        assert parser.answer.reasoning == expected[0] and parser.answer.text == expected[1]


def test_the_formats_are_read_off_the_templates():
    harmony = form_of("gpt-oss.jinja")
    assert harmony.harmony and harmony.tools == [WEATHER]
    qwen = form_of("qwen3.5.jinja", enable_thinking=True)
    assert (qwen.think_start, qwen.think_end, qwen.starts_in_reasoning) == (
        "<think>",
        "</think>",
        True,
    )
    assert qwen.tool_parser.__module__ == "mlx_lm.tool_parsers.qwen3_coder"
    assert not form_of("qwen3.5.jinja", enable_thinking=False).starts_in_reasoning
    gemma = form_of("gemma4.jinja")
    assert (gemma.think_start, gemma.think_end) == ("<|channel>thought", "<channel|>")
    assert gemma.tool_parser.__module__ == "mlx_lm.tool_parsers.gemma4"
    assert not gemma.starts_in_reasoning  # thinking off: the prompt closed an empty thought


def test_harmony_text_streams_as_soon_as_it_cannot_be_a_marker():
    parser = answer_parser(form_of("gpt-oss.jinja"))
    assert parser.feed("<|channel|>final<|message|>") == []  # a header is markup
    assert parser.feed("It is <") == [AnswerText("It is ")]  # `<` may start <|end|>
    assert parser.feed("b>") == [AnswerText("<b>")]
    assert parser.feed("<|ret") == []
    assert parser.feed("urn|>") == []
    assert parser.answer == ParsedAnswer("", "It is <b>")


def test_a_harmony_call_the_answer_ends_in_is_read_without_its_end_token():
    """<|call|> is one of gpt-oss's end tokens: the text may stop before it."""
    parts, parser = parse(form_of("gpt-oss.jinja"), [HARMONY_CALL.removesuffix("<|call|>")])
    assert calls_of(parts) == PARIS and parser.answer.reasoning == "Need the weather tool."


def test_a_harmony_call_that_does_not_parse_is_text_and_a_call_without_tools_too(caplog):
    broken = HARMONY_CALL.replace('{"city": "Paris"}', '{"city": Paris}')
    parts, _ = parse(form_of("gpt-oss.jinja"), [broken])
    assert calls_of(parts) == [] and joined(parts, AnswerText) == '{"city": Paris}'
    assert "did not parse" in caplog.text
    parts, _ = parse(form_of("gpt-oss.jinja", tools=()), [HARMONY_CALL])
    assert calls_of(parts) == [] and joined(parts, AnswerText) == '{"city": "Paris"}'


def test_a_model_that_leaves_harmony_is_read_as_text():
    parts, _ = parse(form_of("gpt-oss.jinja"), list("Hello there."))
    assert joined(parts, AnswerText) == "Hello there."


def test_harmony_reasoning_tokens_are_those_up_to_the_analysis_end():
    tokenizer = tokenizer_with("gpt-oss.jinja")
    parts, parser = parse(answer_format(tokenizer, Conversation(ASK, [WEATHER])), [HARMONY_CALL])
    ids = tuple(tokenizer.encode(HARMONY_CALL))
    analysis = HARMONY_CALL[: HARMONY_CALL.index("<|end|>") + len("<|end|>")]
    assert parser.reasoning_chars == len(analysis)
    assert reasoning_tokens(tokenizer, ids, parser.reasoning_chars) == len(
        tokenizer.encode(analysis)
    )


def test_earlier_reasoning_reaches_each_template_as_it_reads_it():
    """A tool loop's reasoning (kept as `reasoning_content`) is rendered where the template
    shows it: gpt-oss's analysis before its call, Qwen3.5's and Gemma 4's thinking."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather"}}
    call["function"]["arguments"] = {"city": "Paris"}
    history = [
        *ASK,
        {"role": "assistant", "content": "", "reasoning_content": "Need it.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "18C"},
    ]
    shown = {
        "gpt-oss.jinja": "<|channel|>analysis<|message|>Need it.<|end|>",
        "qwen3.5.jinja": "<think>\nNeed it.\n</think>",
        "gemma4.jinja": "<|channel>thought\nNeed it.\n<channel|>",
    }
    for template, expected in shown.items():
        prompt = render_chat(tokenizer_with(template), Conversation(history, [WEATHER]))
        assert expected in prompt, template


def test_a_forced_harmony_call_is_a_commentary_message_after_optional_analysis():
    tokenizer, conversation, grammar = forced("gpt-oss.jinja")
    call = (
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city": "Oslo", "unit": "C"}'
    )
    analysis = "<|channel|>analysis<|message|>Oslo <|en then.<|end|><|start|>assistant"
    assert matched(grammar, tokenizer, call) == "complete"
    assert matched(grammar, tokenizer, analysis + call) == "complete"
    wrong_name = call.replace("get_weather", "get_time")
    assert matched(grammar, tokenizer, wrong_name).startswith("refused")
    final = "<|channel|>final<|message|>Sunny."
    assert matched(grammar, tokenizer, final).startswith("refused")
    parts, parser = parse(answer_format(tokenizer, conversation), [analysis + call])
    assert calls_of(parts) == [("get_weather", {"city": "Oslo", "unit": "C"})]
    assert parser.answer.reasoning == "Oslo <|en then."


def test_a_harmony_schema_answer_is_the_final_message():
    tokenizer = tokenizer_with("gpt-oss.jinja")
    constraint = AnswerConstraint(grammar=Grammar.json_schema({"type": "object"}))
    grammar = answer_grammar(tokenizer, Conversation(ASK), constraint)
    assert matched(grammar, tokenizer, '<|channel|>final<|message|>{"a": 1}') == "complete"
    assert matched(grammar, tokenizer, '{"a": 1}').startswith("refused")


QWEN35_FORCED = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
    "<parameter=unit>\nC\n</parameter>\n</function>\n</tool_call>"
)
GEMMA4_FORCED = '<|tool_call>call:get_weather{city:<|"|>Oslo<|"|>,unit:<|"|>C<|"|>}<tool_call|>'
FORCED_CALLS = {
    "qwen3.5.jinja": (
        QWEN35_FORCED,
        [("<parameter=unit>\nC\n</parameter>\n", ""), ("Oslo", "null"), ("Oslo", "Os</tool_call>")],
    ),
    "gemma4.jinja": (
        GEMMA4_FORCED,
        [(',unit:<|"|>C<|"|>', ""), ("Oslo", 'Os<|"|>lo'), ("{city", "{ city")],
    ),
}


@pytest.mark.parametrize("template", FORCED_CALLS)
def test_a_forced_call_in_qwen35s_or_gemma4s_format_is_the_templates_markup(template):
    """The call the template writes is the grammar's; each parameter as the parser reads
    it back; a missing required parameter, a value the parser would misread, another
    spacing, another tool or a value outside the schema are refused."""
    call, breaks = FORCED_CALLS[template]
    tokenizer, conversation, grammar = forced(template, enable_thinking=True)
    opening = "Hm.\n</think>\n\n" if "qwen" in template else "<|channel>thought\nHm.<channel|>"
    call = opening + call  # thinking on: the reasoning stays free
    assert matched(grammar, tokenizer, call) == "complete", grammar.source
    wrong = [("get_weather", "get_time"), (">\nC\n", ">\nK\n"), (':<|"|>C', ':<|"|>K')]
    for old, new in [*breaks, *wrong]:
        if old in call:
            assert matched(grammar, tokenizer, call.replace(old, new, 1)) != "complete", (old, new)
    parts, _ = parse(answer_format(tokenizer, conversation), [call])
    assert calls_of(parts) == [("get_weather", {"city": "Oslo", "unit": "C"})]


def test_a_forced_gemma4_call_writes_typed_values_as_its_parser_reads_them():
    trip = {
        "type": "object",
        "properties": {
            "days": {"type": "integer", "maximum": 9},
            "metric": {"type": "boolean"},
            "stops": {
                "type": "array",
                "items": {"type": "object", "properties": {"at": {"type": "string"}}},
            },
        },
        "required": ["days"],
    }
    tool = {"type": "function", "function": {"name": "plan", "parameters": trip}}
    tokenizer = tokenizer_with("gemma4.jinja")
    conversation = Conversation(ASK, [tool])
    grammar = answer_grammar(
        tokenizer, conversation, AnswerConstraint(tools=ForcedTools(("plan",)))
    )
    call = '<|tool_call>call:plan{days:3,metric:true,stops:[{at:<|"|>a{b}<|"|>},{}]}<tool_call|>'
    assert matched(grammar, tokenizer, call) == "complete", grammar.source
    parts, _ = parse(answer_format(tokenizer, conversation), [call])
    assert calls_of(parts) == [("plan", {"days": 3, "metric": True, "stops": [{"at": "a{b}"}, {}]})]
    assert matched(grammar, tokenizer, call.replace("days:3", "days:12")) != "complete"
    assert matched(grammar, tokenizer, call.replace("days:3,", "")) != "complete"


def test_generate_and_the_chat_app_show_harmony_analysis_as_reasoning():
    """Both read their pieces through PieceReader: the analysis is reasoning, with who
    wrote it; headers and markers are never shown."""
    reader = PieceReader(tokenizer_with("gpt-oss.jinja"), Conversation(ASK))
    events = [Accepted((), HARMONY_ANSWER[:40]), Bonus((), HARMONY_ANSWER[40:])]
    pieces = [piece for event in events for piece in reader.read(event).pieces]
    reasoning = "".join(piece.text for piece in pieces if piece.reasoning)
    shown = "".join(piece.text for piece in pieces if not piece.reasoning)
    assert (reasoning, shown) == ("The tool said 18C.", "It is 18C <in> Paris.")
    written_by = [(piece.text, piece.source) for piece in pieces if piece.reasoning]
    assert written_by == [("The tool s", Accepted), ("aid 18C.", Bonus)]  # cut at 40


def test_parallel_calls_in_a_harmony_history_are_one_turn_per_call_each_with_its_result():
    """gpt-oss's template writes only a turn's first call and names every result after
    the last call: another model's parallel calls are split before rendering."""
    calls = [
        {"id": f"call_{city}", "type": "function", "function": {"name": name}}
        for city, name in (("paris", "get_weather"), ("utc", "get_time"))
    ]
    calls[0]["function"]["arguments"] = {"city": "Paris"}
    calls[1]["function"]["arguments"] = {"zone": "UTC"}
    history = [
        *ASK,
        {"role": "assistant", "content": "", "reasoning_content": "Both.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_utc", "name": "get_time", "content": "12:00"},
        {"role": "tool", "tool_call_id": "call_paris", "name": "get_weather", "content": "18C"},
    ]
    prompt = render_chat(tokenizer_with("gpt-oss.jinja"), Conversation(history, [WEATHER]))
    assert prompt.endswith(
        "<|start|>assistant<|channel|>analysis<|message|>Both.<|end|>"
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
        '{"city": "Paris"}<|call|>'
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
        '"18C"<|end|>'
        "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>"
        '{"zone": "UTC"}<|call|>'
        "<|start|>functions.get_time to=assistant<|channel|>commentary<|message|>"
        '"12:00"<|end|><|start|>assistant'
    ), prompt[-600:]
