"""`mlxspec chat --plain`: a line-based chat on stdin/stdout, for pipes and dumb terminals.

Each line is a turn; `/quit` or the end of input ends the chat. Accepted drafts are
coloured as in `mlxspec generate`; rejected drafts are left out, as a stream of lines
cannot take text back. A summary of each answer goes to stderr.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import click

from mlxspec.console import COLOURS, echo_text, say
from mlxspec.events import Done, Event
from tui.worker import generation_settings

QUIT = "/quit"


def run_plain(
    runtime,
    proposer: str | None,
    lines: Iterable[str],
    colour: bool,
    prompt: bool,
    stream: Callable[..., Iterator[Event]] | None = None,
):
    """Chat until /quit or the end of `lines`; `prompt` shows a '> ' before each turn.
    `stream`: how an answer is generated (default `runtime.engine.stream`; a sharded
    target's rank 0 passes one that the other ranks follow)."""
    stream = stream or runtime.engine.stream
    settings = generation_settings(runtime.entry)
    proposer_name = runtime.proposer(proposer)
    messages: list[dict] = []
    say(f"chatting with {runtime.entry.name} ({proposer_name}); {QUIT} or end of input ends")
    if prompt:
        click.echo("> ", nl=False)
    for line in lines:
        text = line.strip()
        if text == QUIT:
            break
        if text:
            messages.append({"role": "user", "content": text})
            answer = _answer(stream, messages, settings, proposer_name, colour)
            messages.append({"role": "assistant", "content": answer})
        if prompt:
            click.echo("> ", nl=False)


def _answer(stream, messages, settings, proposer: str, colour: bool) -> str:
    done = None
    for event in stream(messages, settings, proposer):
        if isinstance(event, Done):
            done = event
        elif type(event) in COLOURS:
            echo_text(event, colour)
    click.echo()
    record = done.record
    say(
        f"{record.completion_tokens} tokens, {record.tokens_per_second:.1f} tok/s "
        f"({record.speedup_estimate.value:.2f}x plain), "
        f"accepted {record.accepted}/{record.drafted} drafts ({record.proposer})"
    )
    return done.text
