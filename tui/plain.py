"""`mlxspec chat --plain`: a line-based chat on stdin/stdout, for pipes and dumb terminals.

Each line is a turn; `/quit` or the end of input ends the chat. Accepted drafts are
coloured and reasoning goes to stderr, dimmed, as in `mlxspec generate`; rejected drafts
are left out, as a stream of lines cannot take text back. A summary of each answer goes
to stderr. The chat's history holds the answers, not the reasoning.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import click

from mlxspec.console import say
from mlxspec.events import Done, Event
from mlxspec.markup.conversation import Conversation
from mlxspec.markup.display import PieceReader
from tui.echo import COLOURS, AnswerEcho
from tui.worker import generation_settings

QUIT = "/quit"


def run_plain(
    runtime,
    proposer: str | None,
    lines: Iterable[str],
    colours: tuple[bool, bool],
    prompt: bool,
    stream: Callable[..., Iterator[Event]] | None = None,
):
    """Chat until /quit or the end of `lines`; `colours`: style stdout, stderr; `prompt`
    shows a '> ' before each turn. `stream`: how an answer is generated (default
    `runtime.engine.stream`; a sharded target's rank 0 passes one that the other ranks
    follow)."""
    stream = stream or runtime.engine.stream
    settings = generation_settings(runtime.entry)
    template_kwargs = dict(runtime.entry.defaults.chat_template_kwargs)
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
            conversation = Conversation(list(messages), None, template_kwargs)
            reader = PieceReader(runtime.engine.tokenizer, conversation)
            answer = _answer(stream, conversation, settings, proposer_name, reader, colours)
            messages.append({"role": "assistant", "content": answer})
        if prompt:
            click.echo("> ", nl=False)


def _answer(stream, conversation, settings, proposer: str, reader, colours) -> str:
    """Stream one answer; its text without the reasoning."""
    echo = AnswerEcho(*colours)
    for event in stream(conversation, settings, proposer):
        if isinstance(event, Done):
            finished = reader.finish(event)
        elif type(event) in COLOURS:
            echo.show(reader.read(event).pieces)
    echo.show(finished.pieces)
    echo.end()
    record = finished.answered.done.record
    thought = f" ({record.reasoning_tokens} reasoning)" if record.reasoning_tokens else ""
    say(
        f"{record.completion_tokens} tokens{thought}, {record.tokens_per_second:.1f} tok/s "
        f"({record.speedup_estimate.value:.2f}x plain), "
        f"accepted {record.accepted}/{record.drafted} drafts ({record.proposer})"
    )
    return finished.answered.answer.text
