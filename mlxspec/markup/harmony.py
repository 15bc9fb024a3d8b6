"""gpt-oss's harmony format read as it streams: an answer is a run of messages, each a
header, `<|message|>`, then its body up to `<|end|>`, `<|call|>` or `<|return|>`:

    <|channel|>analysis<|message|>The user asks...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}<|call|>
    <|start|>assistant<|channel|>final<|message|>It is 18C.<|return|>

(the prompt ends in `<|start|>assistant`, so the first header starts at once). The
`analysis` channel is the reasoning; a message to a recipient (`to=functions.NAME`, before
or after the channel) is a tool call, its body the arguments' JSON; `final`, and
`commentary` to no one (a preamble the user may see), are answer text. `<|call|>` and
`<|return|>` end a generation (they are gpt-oss's end tokens, so the text may stop without
them). Headers and markers are never shown; a body's text is released as soon as it
cannot be the start of the marker that ends it, a call whole once it ends.

OpenAI's `openai-harmony` package parses this too, but it loads its o200k encoding from
the network on first use (no offline copy ships with it: openai/harmony issues #46, #95,
#101), and here the text comes
detokenized already; this reader is the few markers above and the house parser's
bookkeeping (parts_parser).
"""

from __future__ import annotations

import json
import re
from typing import Any

from mlxspec.markup.parser_base import PartsParser, Placed, log

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
BODY_ENDS = (END, CALL, RETURN)
ANALYSIS, FINAL, COMMENTARY = "analysis", "final", "commentary"
FUNCTIONS = "functions."  # the namespace the template declares the request's tools in
RECIPIENT = re.compile(r"to=([^\s<]+)")
CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")
HEADER, REASONING, ANSWER, TOOL_CALL = "header", "reasoning", "answer", "tool call"


def is_harmony(template: str) -> bool:
    """Whether a chat template writes harmony's messages (gpt-oss's)."""
    return all(marker in template for marker in (START, CHANNEL, MESSAGE))


class HarmonyParser(PartsParser):
    """Harmony's messages into parts; `tools`, the request's (None: a call is text)."""

    def __init__(self, tools: list[dict[str, Any]] | None):
        super().__init__()
        self.tools = tools
        self._state = HEADER
        self._recipient = ""  # the call being read: its function's name
        self._said = False  # answer text or a call came: later analysis counts no more

    @property
    def in_reasoning(self) -> bool:
        return self._state == REASONING

    def _step(self, parts: list[Placed], final: bool) -> bool:
        if self._state == HEADER:
            return self._in_header(parts, final)
        ended = _first_end(self._buffer)
        if self._state == TOOL_CALL:
            return self._in_call(parts, final, ended)
        at = self.consumed
        if ended is None:
            self._body(parts, self._release(final, *BODY_ENDS), at)
            if final and self._state == REASONING and not self._said:
                self.reasoning_chars = self._fed  # cut off while reasoning: all of it was
            return False
        found, marker = ended
        body, self._buffer = self._buffer[:found], self._buffer[found + len(marker) :]
        self._body(parts, body, at)
        if self._state == REASONING and not self._said:
            self.reasoning_chars = self.consumed
        self._state = HEADER
        return True

    def _in_header(self, parts: list[Placed], final: bool) -> bool:
        """A header is held until its `<|message|>`; text that cannot be one (a model that
        left the format) is answer text from there on."""
        found = self._buffer.find(MESSAGE)
        if found < 0:
            said = self._buffer.lstrip()
            if _may_be_header(said) and not final:
                return False
            if said and not said.startswith((START, CHANNEL, " to=", "to=")):
                self._state = ANSWER
                return True
            self._buffer = ""  # a header the answer ended in: markup, not text
            return False
        header, self._buffer = self._buffer[:found], self._buffer[found + len(MESSAGE) :]
        recipient = RECIPIENT.search(header)
        channel = CHANNEL_NAME.search(header)
        if recipient and self.tools:
            self._state, self._recipient = TOOL_CALL, recipient.group(1)
        elif channel and channel.group(1) == ANALYSIS and not recipient:
            self._state = REASONING
        else:
            self._state = ANSWER
        return True

    def _in_call(self, parts: list[Placed], final: bool, ended: tuple[int, str] | None) -> bool:
        if ended is None and not final:
            return False  # a call is released whole
        found, marker = ended if ended is not None else (len(self._buffer), "")
        body, self._buffer = self._buffer[:found], self._buffer[found + len(marker) :]
        name = self._recipient.removeprefix(FUNCTIONS)
        try:
            self._add_calls(parts, {"name": name, "arguments": json.loads(body)})
        except ValueError as err:  # the text is still the model's answer
            log.warning("a tool call to %s did not parse (%s), kept as text: %r", name, err, body)
            self._say(parts, body, self.consumed - len(marker) - len(body))
        self._said, self._state = True, HEADER
        return ended is not None

    def _body(self, parts: list[Placed], text: str, start: int) -> None:
        if self._state == REASONING:
            self._reason(parts, text, start)
        elif text:
            self._said = True
            self._say(parts, text, start)


def _first_end(text: str) -> tuple[int, str] | None:
    """Where the first marker that ends a body is, and which."""
    found = [(text.find(marker), marker) for marker in BODY_ENDS if marker in text]
    return min(found) if found else None


def _may_be_header(text: str) -> bool:
    """Whether `text` starts as a header may (or is all whitespace)."""
    openings = (START, CHANNEL, " to=", "to=")
    return not text or any(text.startswith(o) or o.startswith(text) for o in openings)
