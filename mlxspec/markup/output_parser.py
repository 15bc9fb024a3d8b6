"""Generated text split into its parts as it streams: reasoning, answer text, tool calls.

The markup comes from the model: mlx-lm's `TokenizerWrapper` knows a model's thinking
markers (`<think>` ... `</think>` where they are tokens) and, for a tokenizer it loaded, its
tool-call markers and parser (`mlx_lm.tool_parsers`). Where it does not, the chat template's
text says: a template that writes `<think>` and `</think>` makes the model write them too,
even where they are plain text to the tokenizer, and mlx-lm's own inference names the
tool-call format from the template. Llama 3.x's format has no marker and no mlx-lm parser:
an answer that opens with `{` (after `<|python_tag|>`, which may be left out) is its calls,
JSON objects separated by `;`, read here. A template without tool support gets the fallback
format (chat_template.py), which is read back here. Whether the answer starts inside the
reasoning is read off the rendered prompt: a template that opens the thinking block in the
generation prompt (DeepSeek-R1's and Qwen3.5's end with `<think>\\n`) leaves only its end to
the model. Gemma 4 thinks in `<|channel>thought` ... `<channel|>` (mlx-lm's markers for it,
read off its template too). gpt-oss's harmony format has no markers of this kind: its
messages on channels are read by harmony.py.

Text is released as soon as it cannot be the start of a marker, so only a possible
marker's prefix is held back. A tool call is released whole, once its end marker is in
(its arguments in one piece): a call that does not parse comes back as answer text, logged,
never as an error. Tool calls are read only where the request gave tools.
"""

from __future__ import annotations

import importlib
import json
import re
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mlx_lm.tokenizer_utils import _infer_tool_parser

from mlxspec.events import Done, TokenEvent
from mlxspec.logprobs import TokenLogprob
from mlxspec.markup.chat_template import render_chat, template_text
from mlxspec.markup.conversation import AnswerPart, Conversation, ParsedAnswer
from mlxspec.markup.harmony import HarmonyParser, is_harmony
from mlxspec.markup.parser_base import PartsParser, Placed, log

# mlx-lm's parser for `<tool_call>{"name": ..., "arguments": ...}</tool_call>`: the format of
# Qwen, Hermes, and our fallback.
JSON_TOOLS = "json_tools"
THINK_START, THINK_END = "<think>", "</think>"
# The thinking markers a template may write, as mlx-lm names them where they are tokens:
# `<think>`'s, and Gemma 4's (its thought channel).
THINKING_MARKERS = ((THINK_START, THINK_END), ("<|channel>thought", "<channel|>"))
# Llama 3.x: an answer that is calls may open with this; its template writes a call as
# `{"name": ..., "parameters": ...}` (the Llama 3.2 template has no python tag, only that).
PYTHON_TAG = "<|python_tag|>"
LLAMA_CALL_RENDERING = "'\"parameters\": '"
CALL_SEPARATOR = re.compile(r"\s*;\s*")

ToolParser = Callable[[str, Any], Any]  # body, tools -> {"name", "arguments"} or a list


@dataclass(frozen=True)
class AnswerFormat:
    """The markup an answer may hold; a marker left None is not looked for."""

    think_start: str | None = None
    think_end: str | None = None
    starts_in_reasoning: bool = False  # the prompt opened the thinking block
    tool_call_start: str | None = None
    tool_call_end: str = ""  # "": a call runs to the end of the answer (Mistral's)
    # Llama's: tool_call_start is a call only where the answer opens with it (after
    # whitespace and PYTHON_TAG), and is the call's first character, not a marker.
    calls_open_answer: bool = False
    tool_parser: ToolParser | None = None
    tools: list[dict[str, Any]] | None = None  # handed to the tool parser
    harmony: bool = False  # gpt-oss's messages on channels (harmony.py), no markers above
    # "on": the model may reason before answering; "off": the prompt closed its thinking
    # block already (a template's enable_thinking=false); "": no thinking markup.
    thinking: str = ""


PLAIN = AnswerFormat()  # raw text completions: nothing is parsed


def answer_format(tokenizer, prompt: object) -> AnswerFormat:
    """What to look for in the answer to `prompt` (a Conversation or bare messages; a raw
    string or token ids are answered as plain text)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        prompt = Conversation(prompt)
    if not isinstance(prompt, Conversation):
        return PLAIN
    template = template_text(tokenizer) or ""
    if is_harmony(template):  # gpt-oss always reasons first (its reasoning_effort sets how long)
        return AnswerFormat(tools=prompt.tools, harmony=True, thinking="on")
    if getattr(tokenizer, "has_thinking", False):
        think_start, think_end = tokenizer.think_start, tokenizer.think_end
    else:
        written = [pair for pair in THINKING_MARKERS if all(m in template for m in pair)]
        think_start, think_end = written[0] if written else (None, None)
    opened, thinking = False, ""
    if think_start is not None:
        rendered = render_chat(tokenizer, prompt)
        opened = rendered.rfind(think_start) > rendered.rfind(think_end)
        thinking = "off" if rendered.rstrip().endswith(think_end) else "on"
    tool_markup = _tool_markup(tokenizer, template) if prompt.tools else {}
    return AnswerFormat(
        think_start, think_end, opened, tools=prompt.tools, thinking=thinking, **tool_markup
    )


def _tool_markup(tokenizer, template: str) -> dict[str, Any]:
    """The tool-call markers and parser: the tokenizer's (mlx-lm loaded it), else mlx-lm's
    inference from the template, else the fallback format's."""
    if getattr(tokenizer, "has_tool_calling", False) and tokenizer.tool_parser is not None:
        source = tokenizer
    else:
        name = _infer_tool_parser(tokenizer) if "tools" in template else None
        if name is None and (PYTHON_TAG in template or LLAMA_CALL_RENDERING in template):
            return {
                "tool_call_start": "{",
                "tool_parser": parse_llama_calls,
                "calls_open_answer": True,
            }
        module = importlib.import_module(f"mlx_lm.tool_parsers.{name or JSON_TOOLS}")
        source = _ToolModule(module.tool_call_start, module.tool_call_end, module.parse_tool_call)
    return {
        "tool_call_start": source.tool_call_start,
        "tool_call_end": source.tool_call_end or "",
        "tool_parser": source.tool_parser,
    }


def parse_llama_calls(text: str, tools: Any) -> list[dict[str, Any]]:
    """Llama 3.x's calls: JSON objects separated by `;`, each a `name` and its `parameters`
    (Meta's word) or `arguments` (some fine-tunes'); ValueError for anything else."""
    decoder, calls, at = json.JSONDecoder(), [], 0
    while True:
        call, at = decoder.raw_decode(text, at)
        if not isinstance(call, dict) or ("parameters" in call) == ("arguments" in call):
            raise ValueError("a call is an object with parameters or arguments")
        calls.append(
            {"name": call.get("name"), "arguments": call.get("parameters", call.get("arguments"))}
        )
        if not text[at:].strip():
            return calls
        separator = CALL_SEPARATOR.match(text, at)
        if separator is None:
            raise ValueError(f"text after a call: {text[at : at + 20]!r}")
        at = separator.end()


@dataclass(frozen=True)
class _ToolModule:
    """A `mlx_lm.tool_parsers` module's markers and parser, named as the tokenizer names them."""

    tool_call_start: str
    tool_call_end: str
    tool_parser: ToolParser


REASONING, ANSWER, TOOL_CALL = "reasoning", "answer", "tool call"


def answer_parser(form: AnswerFormat) -> PartsParser:
    """The reader of answers in `form`."""
    return HarmonyParser(form.tools) if form.harmony else OutputParser(form)


class OutputParser(PartsParser):
    """Markers in the text: `<think>` ... `</think>`, `<tool_call>` ... `</tool_call>` and
    their kin (the AnswerFormat's)."""

    def __init__(self, form: AnswerFormat):
        super().__init__()
        self.form = form
        self._state = REASONING if form.starts_in_reasoning else ANSWER
        # The answer may open a thinking block only before it has said anything else.
        self._may_open_reasoning = form.think_start is not None and not form.starts_in_reasoning
        self._may_open_call = bool(form.tools) and form.calls_open_answer
        # The text that opened the call being read: its marker (Llama's: what came before
        # its `{`), given back with it where it does not parse.
        self._opening = ""
        self._after_marker = False  # whitespace right after a closing marker is dropped

    @property
    def in_reasoning(self) -> bool:
        """Whether the text fed so far ends inside the reasoning."""
        return self._state == REASONING

    def _step(self, parts: list[Placed], final: bool) -> bool:
        """Release what the buffer's start allows; True when a marker moved the state on."""
        if self._state == REASONING:
            return self._in_reasoning(parts, final)
        if self._state == TOOL_CALL:
            return self._in_tool_call(parts, final)
        return self._in_answer(parts, final)

    def _in_reasoning(self, parts: list[Placed], final: bool) -> bool:
        end = self.form.think_end
        found = self._buffer.find(end)
        if found >= 0:
            self._reason(parts, self._buffer[:found], self.consumed)
            self._buffer = self._buffer[found + len(end) :]
            self.reasoning_chars = self._fed - len(self._buffer)
            self._state, self._after_marker = ANSWER, True
            return True
        at = self.consumed
        self._reason(parts, self._release(final, end), at)
        if final:
            self.reasoning_chars = self._fed  # cut off while reasoning: all of it was
        return False

    def _in_answer(self, parts: list[Placed], final: bool) -> bool:
        if self._after_marker:
            self._buffer = self._buffer.lstrip()
            if not self._buffer:
                return False
            self._after_marker = False
        if self._may_open_reasoning:
            start, said = self.form.think_start, self._buffer.lstrip()
            if said.startswith(start):
                self._buffer = said[len(start) :]
                self._state, self._may_open_reasoning = REASONING, False
                return True
            if start.startswith(said) and not final:
                return False  # it may yet be the opening marker
            self._may_open_reasoning = False
        if self._may_open_call:
            return self._open_call(final)
        marked = self.form.tools and not self.form.calls_open_answer
        start = self.form.tool_call_start if marked else None
        found = self._buffer.find(start) if start else -1
        if found >= 0:
            self._say(parts, self._buffer[:found], self.consumed)
            self._opening = start
            self._buffer = self._buffer[found + len(start) :]
            self._state = TOOL_CALL
            return True
        at = self.consumed
        self._say(parts, self._release(final, start), at)
        return False

    def _open_call(self, final: bool) -> bool:
        """Whether the answer opens with a call (Llama's): True once that is decided, False
        while the answer so far (whitespace, part of the python tag) may still open one."""
        said = self._buffer.lstrip()
        if said.startswith(PYTHON_TAG):
            said = said[len(PYTHON_TAG) :].lstrip()
        if said.startswith(self.form.tool_call_start):
            self._opening = self._buffer[: len(self._buffer) - len(said)]
            self._buffer, self._state = said, TOOL_CALL
        elif not final and PYTHON_TAG.startswith(said):  # "" too: nothing said yet
            return False
        self._may_open_call = False
        return True

    def _in_tool_call(self, parts: list[Placed], final: bool) -> bool:
        end = self.form.tool_call_end
        found = self._buffer.find(end) if end else -1
        if found < 0 and not final:
            return False  # a call is released whole
        if found < 0 and end and self._cut:  # cut off before its end: no call, no markup
            log.info("a tool call cut off by the token limit was dropped: %r", self._buffer)
            self._buffer, self._state = "", ANSWER
            return False
        closed = found >= 0
        body = self._buffer[:found] if closed else self._buffer
        self._buffer = self._buffer[found + len(end) :] if closed else ""
        self._call(parts, body, closed)
        self._state, self._after_marker = ANSWER, True
        return closed

    def _call(self, parts: list[Placed], body: str, closed: bool) -> None:
        try:
            self._add_calls(parts, self.form.tool_parser(body, self.form.tools))
        except Exception as err:  # any parser's failure: the text is still the model's answer
            log.warning("a tool call did not parse (%s), kept as text: %r", err, body)
            end = self.form.tool_call_end if closed else ""
            text = f"{self._opening}{body}{end}"
            self._say(parts, text, self.consumed - len(text))


def reasoning_tokens(tokenizer, token_ids: tuple[int, ...], reasoning_chars: int) -> int:
    """How many of the first output tokens it takes to write the first `reasoning_chars`
    characters of the answer (the reasoning and its markers)."""
    if reasoning_chars <= 0:
        return 0
    low, high = 1, len(token_ids)  # the answer: the fewest tokens whose text reaches it
    while low < high:
        middle = (low + high) // 2
        if len(tokenizer.decode(list(token_ids[:middle]))) >= reasoning_chars:
            high = middle
        else:
            low = middle + 1
    return high


@dataclass(frozen=True)
class PartsOf:
    """An output event and the answer parts its text completed; where the request asked
    for logprobs, the entries of the tokens whose text the parser let go of with them
    (released in these parts, or dropped as markup), which may be earlier events' tokens."""

    event: TokenEvent
    parts: tuple[AnswerPart, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True)
class Answered:
    """The end of a generation: its Done (its record counting the reasoning tokens), the
    whole answer, and the parts the end released (text held back for a marker that never
    came, a call the answer ended in), with the logprob entries still held (where asked)."""

    done: Done
    answer: ParsedAnswer
    parts: tuple[AnswerPart, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None


class AnswerReader:
    """One generation's events read into answer parts (the server's workers, the TUI)."""

    def __init__(self, tokenizer, prompt: object):
        self.tokenizer = tokenizer
        self.format = answer_format(tokenizer, prompt)
        self.parser = answer_parser(self.format)
        # Logprob entries of tokens whose text the parser still holds, in order.
        self._held_logprobs: deque[TokenLogprob] = deque()

    def read(self, event: TokenEvent | Done) -> PartsOf | Answered:
        if not isinstance(event, Done):
            parts = tuple(self.parser.feed(event.text))
            if event.logprobs is None:
                return PartsOf(event, parts)
            self._held_logprobs.extend(event.logprobs)
            return PartsOf(event, parts, self._let_go(self.parser.consumed))
        return self.answered(event, self.parser.finish(cut=event.record.finish_reason == "length"))

    def answered(self, done: Done, parts: list[AnswerPart]) -> Answered:
        """The end, once the parser has finished (`parts`: what finishing released)."""
        done.record.thinking = self.format.thinking
        done.record.reasoning_tokens = reasoning_tokens(
            self.tokenizer, done.token_ids, self.parser.reasoning_chars
        )
        logprobs = None
        if done.logprobs is not None:  # the end lets go of every entry still held
            logprobs, self._held_logprobs = tuple(self._held_logprobs), deque()
        return Answered(done, self.parser.answer, tuple(parts), logprobs)

    def _let_go(self, consumed: int) -> tuple[TokenLogprob, ...]:
        """The held entries of the tokens whose text starts before `consumed` characters
        (a token that adds no text yet, a piece of a character, waits for the next)."""
        released = []
        while self._held_logprobs and self._held_logprobs[0].offset < consumed:
            released.append(self._held_logprobs.popleft())
        return tuple(released)
