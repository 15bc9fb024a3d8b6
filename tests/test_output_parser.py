"""The output parser on real markup: each format's answer, cut into pieces at every point,
gives the same parts; text is held back only while it may still be a marker; a call that
does not parse is answer text."""

from __future__ import annotations

import json
import logging

import pytest
from tiny_models import byte_tokenizer
from tool_examples import ASK, CALLED, TEMPLATES, WEATHER

from mlxspec.events import Bonus
from mlxspec.logprobs import TokenLogprob
from mlxspec.markup.conversation import (
    AnswerText,
    Conversation,
    ParsedAnswer,
    ReasoningText,
    ToolCallArguments,
    ToolCallStarted,
)
from mlxspec.markup.output_parser import (
    AnswerFormat,
    AnswerReader,
    OutputParser,
    answer_format,
    reasoning_tokens,
)

# Qwen3's answer: reasoning, a sentence, two calls made at once.
QWEN3_ANSWER = (
    "<think>\nTwo cities: two calls.\n</think>\n\nLet me look.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
    '{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
)
QWEN3_PARSED = ParsedAnswer("\nTwo cities: two calls.\n", "Let me look.\n", ())


def tokenizer_with(template: str | None):
    tokenizer = byte_tokenizer()
    tokenizer._tokenizer.chat_template = (TEMPLATES / template).read_text() if template else None
    return tokenizer


def form_of(template: str | None, tools=(WEATHER,), **kwargs) -> AnswerFormat:
    conversation = Conversation(ASK, list(tools) or None, kwargs)
    return answer_format(tokenizer_with(template), conversation)


def parse(form: AnswerFormat, pieces: list[str]) -> tuple[list, ParsedAnswer]:
    parser = OutputParser(form)
    parts = [part for piece in pieces for part in parser.feed(piece)]
    return parts + parser.finish(), parser.answer


def joined(parts, kind) -> str:
    return "".join(part.text for part in parts if isinstance(part, kind))


def calls_of(parts) -> list[tuple[str, dict]]:
    names = {part.index: part.name for part in parts if isinstance(part, ToolCallStarted)}
    arguments: dict[int, str] = {}
    for part in parts:
        if isinstance(part, ToolCallArguments):
            arguments[part.index] = arguments.get(part.index, "") + part.text
    return [(names[index], json.loads(arguments[index])) for index in sorted(names)]


def test_qwen3_markup_is_read_from_the_template():
    form = form_of("qwen3.jinja")
    assert (form.think_start, form.think_end) == ("<think>", "</think>")
    assert (form.tool_call_start, form.tool_call_end) == ("<tool_call>", "</tool_call>")
    assert not form.starts_in_reasoning  # Qwen3 leaves opening the block to the model


@pytest.mark.parametrize("cut", range(1, len(QWEN3_ANSWER)))
def test_an_answer_cut_anywhere_gives_the_same_parts(cut):
    parts, answer = parse(form_of("qwen3.jinja"), [QWEN3_ANSWER[:cut], QWEN3_ANSWER[cut:]])
    assert (answer.reasoning, answer.text) == (QWEN3_PARSED.reasoning, QWEN3_PARSED.text)
    assert joined(parts, ReasoningText) == QWEN3_PARSED.reasoning
    assert joined(parts, AnswerText) == QWEN3_PARSED.text
    assert calls_of(parts) == CALLED


BROKEN_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>'


@pytest.mark.parametrize(
    "answer_text",
    [QWEN3_ANSWER, f"<think>a <b</think>\n\nSure. {BROKEN_CALL} Done <"],
    ids=["calls", "a broken call"],
)
def test_each_text_part_says_where_its_text_was_fed(answer_text):
    """Front ends colour text by the event that wrote it, held back or not."""
    for cut in [*range(1, len(answer_text)), None]:
        pieces = list(answer_text) if cut is None else [answer_text[:cut], answer_text[cut:]]
        parser = OutputParser(form_of("qwen3.jinja"))
        placed = [p for piece in pieces for p in parser.feed_placed(piece)]
        placed += parser.finish_placed()
        texts = [p for p in placed if isinstance(p.part, (ReasoningText, AnswerText))]
        assert texts and all(
            answer_text[p.start : p.start + len(p.part.text)] == p.part.text for p in texts
        )
        starts = [p.start for p in texts]
        assert starts == sorted(starts)


def test_an_answer_fed_a_character_at_a_time_streams_its_parts_in_order():
    parts, answer = parse(form_of("qwen3.jinja"), list(QWEN3_ANSWER))
    kinds = [type(part) for part in parts]
    first_text, first_call = kinds.index(AnswerText), kinds.index(ToolCallStarted)
    assert set(kinds[:first_text]) == {ReasoningText}
    assert first_text < first_call
    assert kinds[first_call:] == [ToolCallStarted, ToolCallArguments] * 2
    assert [call.name for call in answer.tool_calls] == ["get_weather"] * 2
    ids = [call.id for call in answer.tool_calls]
    assert all(i.startswith("call_") and len(i) == 29 for i in ids) and len(set(ids)) == 2
    assert [part.id for part in parts if isinstance(part, ToolCallStarted)] == ids
    assert [json.loads(call.arguments) for call in answer.tool_calls] == [c[1] for c in CALLED]


def test_only_a_possible_markers_start_is_held_back():
    parser = OutputParser(form_of("qwen3.jinja"))
    assert parser.feed("Hi") == [AnswerText("Hi")]  # no longer a possible "<think>"
    assert parser.feed(" there <tool") == [AnswerText(" there ")]
    assert parser.feed("kit> ok") == [AnswerText("<toolkit> ok")]
    assert parser.feed("<") == []
    assert parser.finish() == [AnswerText("<")]


def test_reasoning_the_prompt_opened_needs_no_opening_marker():
    form = form_of("deepseek-r1-distill.jinja")
    assert form.starts_in_reasoning
    parts, answer = parse(form, ["Paris is in", " France.\n</th", "ink>\n\nIt is sunny."])
    assert (answer.reasoning, answer.text) == ("Paris is in France.\n", "It is sunny.")


def test_thinking_turned_off_closes_the_block_in_the_prompt():
    assert not form_of("qwen3.jinja", enable_thinking=False).starts_in_reasoning
    parts, answer = parse(form_of("qwen3.jinja", enable_thinking=False), ["It is sunny."])
    assert answer == ParsedAnswer("", "It is sunny.")


def test_an_answer_cut_off_while_reasoning_is_all_reasoning():
    parts, answer = parse(form_of("qwen3.jinja"), ["<think>\nHmm, the wea", "ther in </thi"])
    assert answer == ParsedAnswer("\nHmm, the weather in </thi", "")


def test_a_call_that_does_not_parse_is_answer_text_and_logged(caplog):
    broken = BROKEN_CALL
    with caplog.at_level(logging.WARNING, logger="mlxspec.output"):
        parts, answer = parse(form_of("qwen3.jinja"), ["Sure. ", broken, " Done."])
    assert answer.tool_calls == ()
    assert answer.text == "Sure. " + broken + "Done."
    assert "did not parse" in caplog.text


def test_a_call_the_answer_ends_in_is_read_without_its_end_marker():
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
    parts, answer = parse(form_of("hermes3.jinja"), [call])
    assert calls_of(parts) == CALLED[:1] and answer.text == ""


def test_tool_markup_is_text_where_the_request_gave_no_tools():
    parts, answer = parse(form_of("qwen3.jinja", tools=()), [QWEN3_ANSWER])
    assert answer.tool_calls == () and "<tool_call>" in answer.text


def test_mistral_calls_run_to_the_end_of_the_answer():
    form = form_of("mistral-nemo.jinja")
    assert (form.tool_call_start, form.tool_call_end) == ("[TOOL_CALLS]", "")
    answer_text = (
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abc123XYZ"},'
        ' {"name": "get_weather", "arguments": {"city": "Rome"}, "id": "def456UVW"}]'
    )
    parts, answer = parse(form, [answer_text[:20], answer_text[20:]])
    assert calls_of(parts) == CALLED
    assert [call.id for call in answer.tool_calls] == ["abc123XYZ", "def456UVW"]


@pytest.mark.parametrize("template", ["smollm2.jinja", None])
def test_a_model_without_tool_support_is_read_in_the_fallback_format(template):
    form = form_of(template)
    assert (form.tool_call_start, form.tool_call_end) == ("<tool_call>", "</tool_call>")
    assert form.think_start is None  # nothing in its template or vocabulary says <think>
    parts, answer = parse(form, ["<think>x</think>", QWEN3_ANSWER.split("</think>\n\n")[1]])
    assert calls_of(parts) == CALLED
    assert answer.text.startswith("<think>x</think>Let me look.")


def test_plain_completions_parse_nothing():
    form = answer_format(tokenizer_with("qwen3.jinja"), "a raw prompt")
    parts, answer = parse(form, [QWEN3_ANSWER])
    assert answer == ParsedAnswer("", QWEN3_ANSWER) and parts == [AnswerText(QWEN3_ANSWER)]


def test_reasoning_tokens_are_those_that_write_the_reasoning_and_its_markers():
    tokenizer = byte_tokenizer()
    text = "<think>ab</think>cd"
    ids = tuple(tokenizer.encode(text))
    parser = OutputParser(form_of("qwen3.jinja"))
    parser.feed(text)
    parser.finish()
    assert parser.reasoning_chars == len("<think>ab</think>")
    assert reasoning_tokens(tokenizer, ids, parser.reasoning_chars) == len("<think>ab</think>")
    assert reasoning_tokens(tokenizer, ids, 0) == 0


# Llama 3.x's calls are bare JSON, the answer's whole text, Meta's `parameters` or a
# fine-tune's `arguments`, several separated by `;`.
PARIS_CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
ROME_CALL = '{"name": "get_weather", "arguments": {"city": "Rome"}}'
LLAMA_ANSWERS = {
    "one": (PARIS_CALL, CALLED[:1]),
    "two": (f"{PARIS_CALL}; {ROME_CALL}", CALLED),
    "python tag": (f"<|python_tag|>{PARIS_CALL};{ROME_CALL}\n", CALLED),
}


def test_llama_calls_are_read_from_the_template():
    form = form_of("llama3.3.jinja")
    assert (form.tool_call_start, form.tool_call_end, form.calls_open_answer) == ("{", "", True)


@pytest.mark.parametrize("answer_text, called", LLAMA_ANSWERS.values(), ids=list(LLAMA_ANSWERS))
def test_a_llama_answer_that_is_json_is_its_calls_cut_anywhere(answer_text, called):
    for cut in range(1, len(answer_text)):
        parts, answer = parse(form_of("llama3.3.jinja"), [answer_text[:cut], answer_text[cut:]])
        assert calls_of(parts) == called and answer.text == "", cut


def test_llama_prose_is_text_as_it_streams_even_where_it_holds_json():
    parser = OutputParser(form_of("llama3.3.jinja"))
    assert parser.feed(" <|python") == []  # it may yet open a call
    assert parser.feed("ic|> says ") == [AnswerText(" <|pythonic|> says ")]
    assert parser.feed(PARIS_CALL) == [AnswerText(PARIS_CALL)]
    assert parser.finish() == [] and parser.answer.tool_calls == ()


@pytest.mark.parametrize(
    "answer_text",
    [
        '<|python_tag|> {"name": "get_weather", "parameters": {"city": ',
        f"{PARIS_CALL} is what I would call.",
        f"{PARIS_CALL} {ROME_CALL}",
        '{"city": "Paris"}',
        '{"name": "get_weather", "parameters": {"city": "Paris"}, "arguments": {}}',
    ],
    ids=["cut off", "prose after it", "no separator", "no name", "both words"],
)
def test_llama_json_that_is_not_calls_is_answer_text_and_logged(answer_text, caplog):
    with caplog.at_level(logging.WARNING, logger="mlxspec.output"):
        parts, answer = parse(form_of("llama3.3.jinja"), [answer_text[:9], answer_text[9:]])
    assert answer.tool_calls == () and answer.text == answer_text
    assert joined(parts, AnswerText) == answer_text and "did not parse" in caplog.text


def test_llama_json_is_text_where_the_request_gave_no_tools():
    parts, answer = parse(form_of("llama3.3.jinja", tools=()), [PARIS_CALL])
    assert answer == ParsedAnswer("", PARIS_CALL)


@pytest.mark.parametrize(
    "answer, shown",
    [
        # a call begun and cut off by the token limit
        ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"ci', "Let me look.\n"),
        # the start of a marker, held back when the limit came
        ("Let me look.\n<tool", "Let me look.\n"),
        # cut inside the reasoning: its end marker's start is not reasoning
        ("<think>\nTwo cities</th", ""),
    ],
)
def test_an_answer_cut_by_its_token_limit_leaks_no_markup(answer, shown):
    """The parts and the answer hold no markup a cut left unfinished (SmolLM2, forced to
    call, once ended its content in "<tool", a third call's start)."""
    form = form_of("qwen3.jinja")
    for cut in range(1, len(answer)):
        parser = OutputParser(form)
        parts = parser.feed(answer[:cut]) + parser.feed(answer[cut:]) + parser.finish(cut=True)
        assert joined(parts, AnswerText) == shown == parser.answer.text
        assert "<" not in joined(parts, ReasoningText) and not parser.answer.tool_calls
    # an answer that ended on its own, with the same text, keeps it as text: it is the model's
    parser = OutputParser(form)
    parts = parser.feed(answer) + parser.finish()
    assert joined(parts, AnswerText) + joined(parts, ReasoningText) != shown


def test_a_call_that_never_closed_and_does_not_parse_is_given_back_as_written():
    """The answer ended (not cut) inside a call that does not parse: its text comes back
    as the model wrote it, with no end marker it never wrote."""
    written = '<tool_call>\n{"name": "get_weather", "arguments": {"city": '
    parts, answer = parse(form_of("qwen3.jinja"), [written])
    assert answer.tool_calls == () and answer.text == written


def test_a_held_tokens_logprob_waits_for_its_text():
    """A token whose text the parser holds (a possible marker's start) keeps its logprob
    entry until that text is let go of, so the entry rides on the chunk with its text."""
    reader = AnswerReader(tokenizer_with("qwen3.jinja"), Conversation(ASK, [WEATHER]))
    first = TokenLogprob(1, "Hi ", -0.1, offset=0)
    held = TokenLogprob(2, "<", -0.2, offset=3)
    said = reader.read(Bonus((1,), "Hi ", logprobs=(first,)))
    assert joined(said.parts, AnswerText) == "Hi " and said.logprobs == (first,)
    waiting = reader.read(Bonus((2,), "<", logprobs=(held,)))
    assert waiting.parts == () and waiting.logprobs == ()
    let_go = reader.read(Bonus((3,), "b", logprobs=(TokenLogprob(3, "b", -0.3, offset=4),)))
    assert joined(let_go.parts, AnswerText) == "<b" and [e.token for e in let_go.logprobs] == [2, 3]
