"""An answer's text by part and by provenance, for the front ends that colour both.

`mlxspec generate`, `chat --plain` and the chat TUI show the reasoning apart from the
answer and accepted drafts apart from the target's own tokens. The output parser says
which part text belongs to; it may hold text back (a marker's possible start) and release
it with a later event, so who wrote each character is read off where the parser placed
it in the text fed, not off the event that released it.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

from mlxspec.events import Done, TokenEvent
from mlxspec.markup.conversation import AnswerText, ReasoningText
from mlxspec.markup.output_parser import Answered, AnswerReader, Placed


@dataclass(frozen=True)
class Piece:
    """Text of one part written by one kind of event."""

    text: str
    source: type[TokenEvent]  # Accepted: an accepted draft; Corrected, Bonus: the target's own
    reasoning: bool


@dataclass(frozen=True)
class Written:
    """A text event and the pieces its text released."""

    event: TokenEvent
    pieces: tuple[Piece, ...]
    reasoning: bool  # the event's text began inside the reasoning or opened it


@dataclass(frozen=True)
class Finished:
    """The end: the answer read whole (its record counting the reasoning tokens) and the
    pieces the end released."""

    answered: Answered
    pieces: tuple[Piece, ...]


class PieceReader:
    """One generation's text events read into pieces (a prompt that is no conversation, or
    a template without thinking markers, gives answer pieces only)."""

    def __init__(self, tokenizer, prompt: object):
        self._reader = AnswerReader(tokenizer, prompt)
        self._starts: list[int] = []  # where each text event's text starts in all fed
        self._sources: list[type[TokenEvent]] = []
        self._fed = 0

    def read(self, event: TokenEvent) -> Written:
        parser = self._reader.parser
        began_in_reasoning = parser.in_reasoning
        self._starts.append(self._fed)
        self._sources.append(type(event))
        self._fed += len(event.text)
        pieces = self._pieces(parser.feed_placed(event.text))
        return Written(event, pieces, began_in_reasoning or parser.in_reasoning)

    def finish(self, done: Done) -> Finished:
        placed = self._reader.parser.finish_placed(cut=done.record.finish_reason == "length")
        answered = self._reader.answered(done, [p.part for p in placed])
        return Finished(answered, self._pieces(placed))

    def _pieces(self, placed: list[Placed]) -> tuple[Piece, ...]:
        """Text parts cut where the event that wrote them changes; tool calls left out."""
        pieces = []
        for item in placed:
            if not isinstance(item.part, (ReasoningText, AnswerText)):
                continue
            reasoning = isinstance(item.part, ReasoningText)
            text, at = item.part.text, item.start
            while text:
                writer = bisect_right(self._starts, at) - 1
                end = self._starts[writer + 1] if writer + 1 < len(self._starts) else self._fed
                pieces.append(Piece(text[: end - at], self._sources[writer], reasoning))
                text, at = text[end - at :], end
        return tuple(pieces)
