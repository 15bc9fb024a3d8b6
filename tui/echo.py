"""An answer streamed to a terminal: the answer on stdout, the reasoning dimmed on stderr,
accepted drafts coloured in both; for `mlxspec generate` and `chat --plain`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import click

from mlxspec.events import Accepted, Bonus, Corrected

if TYPE_CHECKING:  # the parser's imports (transformers) wait for a command that answers
    from mlxspec.markup.display import Piece

# Text events and the colour each is shown in (None: the terminal's own).
COLOURS = {Accepted: "green", Corrected: None, Bonus: None}


class AnswerEcho:
    """Streams an answer's pieces: the answer to stdout, the reasoning to stderr, dimmed,
    so a pipe gets the answer alone; accepted drafts coloured in both. `colour`: style
    stdout; `reasoning_colour`: style stderr (each defaults to its stream being a TTY)."""

    def __init__(self, colour: bool, reasoning_colour: bool):
        self.colour, self.reasoning_colour = colour, reasoning_colour
        self._reasoning_line_open = False  # the reasoning on stderr wants a newline
        self._reasoning_started = False

    def show(self, pieces: Iterable[Piece]) -> None:
        for piece in pieces:
            if piece.reasoning:
                self._reason(piece)
            else:
                self._close_reasoning()
                style = COLOURS[piece.source] if self.colour else None
                # color=: click would strip the colours from a pipe even with --color.
                text = click.style(piece.text, fg=style) if style else piece.text
                click.echo(text, nl=False, color=self.colour)

    def end(self) -> None:
        """End the answer's line (and the reasoning's, if the answer never came)."""
        self._close_reasoning()
        click.echo()

    def _reason(self, piece: Piece) -> None:
        text = piece.text if self._reasoning_started else piece.text.lstrip()
        if not text:
            return
        self._reasoning_started = True
        self._reasoning_line_open = not text.endswith("\n")
        if self.reasoning_colour:
            text = click.style(text, fg=COLOURS[piece.source], dim=True)
        click.echo(text, nl=False, err=True, color=self.reasoning_colour)

    def _close_reasoning(self) -> None:
        if self._reasoning_line_open:
            click.echo(err=True)
            self._reasoning_line_open = False
