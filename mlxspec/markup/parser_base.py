"""What every reader of a model's markup shares: text fed piece by piece, parts released
with where their text was fed, text held back only while it may still start a marker, and
tool calls checked into one shape.

The readers are `output_parser.OutputParser` (markers in the text: `<think>`, `<tool_call>`
and their kin) and `harmony.HarmonyParser` (gpt-oss's messages on channels); each says in
`_step` what the start of its buffer allows.
"""

from __future__ import annotations

import json
import logging
import secrets
from dataclasses import dataclass
from typing import Any

from mlxspec.markup.conversation import (
    AnswerPart,
    AnswerText,
    ParsedAnswer,
    ReasoningText,
    ToolCall,
    ToolCallArguments,
    ToolCallStarted,
)

log = logging.getLogger("mlxspec.output")


@dataclass(frozen=True)
class Placed:
    """A part, and where its text starts in all the parser was fed (None: a tool call's
    parts, read from a call's markup rather than copied from it), so a front end can tell
    which output event wrote each character even where text was held back for a marker."""

    part: AnswerPart
    start: int | None = None


class PartsParser:
    """Feed it the generated text piece by piece; each piece gives the parts it completed.
    `finish()` releases what was held back; `answer` is then the whole answer. An answer
    `cut` by its token limit releases no unfinished markup: the start of a marker, or a call
    whose closing marker never came, is dropped rather than shown as text."""

    def __init__(self) -> None:
        self._buffer = ""  # fed, not yet released
        self._fed = 0  # characters fed so far
        self.reasoning_chars = 0  # text fed up to the reasoning's end marker (included)
        self._reasoning: list[str] = []
        self._text: list[str] = []
        self._calls: list[ToolCall] = []
        self._cut = False  # finishing an answer its token limit cut off

    def feed(self, text: str) -> list[AnswerPart]:
        return [placed.part for placed in self.feed_placed(text)]

    def finish(self, cut: bool = False) -> list[AnswerPart]:
        return [placed.part for placed in self.finish_placed(cut)]

    def feed_placed(self, text: str) -> list[Placed]:
        """`feed`, each part with where its text lies in all that was fed."""
        self._buffer += text
        self._fed += len(text)
        parts: list[Placed] = []
        while self._step(parts, final=False):
            pass
        return parts

    def finish_placed(self, cut: bool = False) -> list[Placed]:
        self._cut = cut
        parts: list[Placed] = []
        while self._step(parts, final=True):
            pass
        return parts

    @property
    def consumed(self) -> int:
        """Characters fed and no longer held (released in parts, or dropped as markup):
        where the buffer starts in all that was fed."""
        return self._fed - len(self._buffer)

    @property
    def in_reasoning(self) -> bool:
        """Whether the text fed so far ends inside the reasoning."""
        raise NotImplementedError

    @property
    def answer(self) -> ParsedAnswer:
        return ParsedAnswer("".join(self._reasoning), "".join(self._text), tuple(self._calls))

    def _step(self, parts: list[Placed], final: bool) -> bool:
        """Release what the buffer's start allows; True when a marker moved the state on."""
        raise NotImplementedError

    def _release(self, final: bool, *markers: str | None) -> str:
        """Take from the buffer all but the longest end that may start one of `markers`."""
        keep = 0
        if not final or self._cut:
            keep = max((marker_prefix(self._buffer, m) for m in markers if m), default=0)
        released = self._buffer[: len(self._buffer) - keep]
        self._buffer = "" if final else self._buffer[len(released) :]  # cut: a marker's start
        return released

    def _add_calls(self, parts: list[Placed], parsed: Any) -> None:
        """The calls a tool parser returned, as parts; ValueError where they are not calls."""
        for name, arguments, call_id in parsed_calls(parsed):
            index = len(self._calls)
            self._calls.append(ToolCall(call_id, name, arguments))
            parts.append(Placed(ToolCallStarted(index, call_id, name)))
            parts.append(Placed(ToolCallArguments(index, arguments)))

    def _reason(self, parts: list[Placed], text: str, start: int) -> None:
        if text:
            self._reasoning.append(text)
            parts.append(Placed(ReasoningText(text), start))

    def _say(self, parts: list[Placed], text: str, start: int) -> None:
        if text:
            self._text.append(text)
            parts.append(Placed(AnswerText(text), start))


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def marker_prefix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def parsed_calls(parsed: Any) -> list[tuple[str, str, str]]:
    """(name, arguments as JSON text, id) of each call a tool parser returned; ValueError
    for anything that is not a call with a name and an object of arguments."""
    calls = parsed if isinstance(parsed, list) else [parsed]
    if not calls:
        raise ValueError("no call in it")
    out = []
    for call in calls:
        name, arguments = call.get("name"), call.get("arguments", {})
        if isinstance(arguments, str):
            arguments = json.loads(arguments)
        if not isinstance(name, str) or not name or not isinstance(arguments, dict):
            raise ValueError("a call needs a name and an object of arguments")
        call_id = call.get("id") if isinstance(call.get("id"), str) else new_call_id()
        out.append((name, json.dumps(arguments, ensure_ascii=False), call_id))
    return out
