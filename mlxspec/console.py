"""Terminal output shared by the CLI and `chat --plain`: one-line messages, coloured tokens.

It sits below both front ends (they import it, it imports neither), so the CLI can start
the plain chat without the two importing each other.
"""

from __future__ import annotations

import sys

import click

from mlxspec import blas
from mlxspec.events import Accepted, Bonus, Corrected, Event, ProgressNote

# Text events and the colour each is shown in (None: the terminal's own).
COLOURS = {Accepted: "green", Corrected: None, Bonus: None}

_open_line = False  # a progress note is showing on stderr and the next one replaces it


def say(message: str) -> None:
    """One line on stderr. On a terminal a ProgressNote overwrites the note before it,
    so a long measurement shows how far it is on one line instead of scrolling."""
    global _open_line
    line = f"mlxspec: {message}"
    if isinstance(message, ProgressNote) and sys.stderr.isatty():
        end = "\n" if message.done >= message.total else ""
        click.echo(f"\r{line}\x1b[K{end}", nl=False, err=True)
        _open_line = not end
        return
    if isinstance(message, ProgressNote) and 0 < message.done < message.total:
        return  # off a terminal: the first and the last note, not every step
    if _open_line:
        click.echo(err=True)
        _open_line = False
    click.echo(line, err=True)


def echo_text(event: Event, colour: bool) -> None:
    """Stream one text event to stdout, accepted drafts coloured when `colour`."""
    style = COLOURS[type(event)] if colour else None
    # color=colour: click would strip the colours from a pipe even with --color.
    click.echo(click.style(event.text, fg=style) if style else event.text, nl=False, color=colour)


def warn_if_slow_blas() -> None:
    """One line on stderr when MLX runs on the reference BLAS (why nothing is drafted)."""
    hint = blas.slow_blas_hint()
    if hint:
        say(hint)
