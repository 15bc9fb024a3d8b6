"""One-line messages on stderr, shared by every command and the layers they start.

A leaf at the package root: the CLI, `chat --plain`, `--ranks`' launcher and the drafter
commands all say things, and none of them need import another to do it. An answer streamed
to the terminal, coloured, is `tui.echo`'s.
"""

from __future__ import annotations

import sys

import click

from mlxspec import blas
from mlxspec.events import ProgressNote

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


def warn_if_slow_blas() -> None:
    """One line on stderr when MLX runs on the reference BLAS (why nothing is drafted)."""
    hint = blas.slow_blas_hint()
    if hint:
        say(hint)
