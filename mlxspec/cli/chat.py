"""`mlxspec chat`: the chat TUI, or a line chat off a terminal; sharded when asked."""

from __future__ import annotations

import sys
from functools import partial

import click

from mlxspec.cli.errors import fail_cleanly
from mlxspec.cli.options import (
    NO_HISTORY_OPTION,
    PROPOSER_OPTION,
    TREE_OPTION,
    WEIGHTS_OPTION,
    chat_template_args_option,
    kv_defaults,
    kv_options,
    model_option,
    penalty_options,
    prompt_cache_options,
)
from mlxspec.console import say, warn_if_slow_blas
from mlxspec.distributed.errors import DistributedError
from mlxspec.distributed.options import distributed_options
from mlxspec.registry.models_toml import load_registry


@click.command()
@model_option()
@PROPOSER_OPTION
@click.option(
    "--plain", is_flag=True, help="Line-based chat on stdin/stdout (default off a terminal)."
)
@click.option(
    "--color/--no-color",
    default=None,
    help="--plain: colour accepted drafts and dim the reasoning (default: on a TTY).",
)
@chat_template_args_option()
@TREE_OPTION
@NO_HISTORY_OPTION
@WEIGHTS_OPTION
@prompt_cache_options
@kv_options
@penalty_options
@distributed_options
@fail_cleanly
def chat(
    model,
    proposer,
    plain,
    color,
    chat_template_args,
    tree,
    no_history,
    weights,
    presence_penalty,
    frequency_penalty,
):
    """Chat with a model and watch speculation at work.

    Accepted drafts are coloured as they stream in; the status bar shows the proposer,
    draft length, acceptance and speed. A model's thinking shows apart, dimmed, and
    folds once the answer starts (ctrl+g unfolds it; ctrl+s turns thinking off). --plain
    reads one turn per line, its reasoning to stderr; /quit ends.

    \b
    Examples:
      mlxspec chat
      mlxspec chat --model qwen3.5-9b --proposer dflash
      printf 'Name three primes\\n/quit\\n' | mlxspec chat --plain
      mlxspec chat --ranks 3     # the target sharded over 3 local ranks, same chat
    """
    from mlxspec.distributed.rank import current_rank

    registry = (
        load_registry()
        .including(model)
        .with_defaults(
            tree=tree,
            history=False if no_history else None,
            weights=weights,
            chat_template_kwargs=chat_template_args,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            **kv_defaults(),
        )
    )
    entry = registry.get(model)
    entry.proposer(proposer)  # validate before loading weights
    warn_if_slow_blas()
    rank = current_rank()  # None unless run with --ranks/--hostfile
    if rank is None:
        from mlxspec.registry.runtime import check_before_loading

        check_before_loading(entry)  # one line, before the screen opens or weights load
    if rank is not None and not rank.front:  # the other ranks run what rank 0 announces
        rank.follow(rank.open_runtime(entry, say, calibrate=True, follows=True))
        return
    # (With the jaccl or mpi backend, mlx.launch gives rank 0 pipes: the line chat.)
    if plain or not (sys.stdin.isatty() and sys.stdout.isatty()):
        from mlxspec.registry.runtime import open_runtime
        from tui.plain import run_plain

        if rank is None:
            runtime, stream = open_runtime(entry, notify=say), None
        else:
            runtime = rank.open_runtime(entry, say, calibrate=True, follows=True)
            stream = partial(rank.stream, runtime)
        colours = (
            sys.stdout.isatty() if color is None else color,
            sys.stderr.isatty() if color is None else color,
        )
        run_plain(runtime, proposer, sys.stdin, colours, sys.stdin.isatty(), stream)
        runtime.engine.save_prompts()  # the next chat on this model starts warm
        if rank is not None:
            rank.end_following()
        return
    from tui.app import ChatApp

    if rank is None:
        ChatApp(registry, entry.name, proposer).run()
        return
    app = ChatApp(
        registry,
        entry.name,
        proposer,
        lambda entry, notify: rank.open_runtime(entry, notify, calibrate=True, follows=True),
        ranks=rank,
    )
    rank.on_lost = app.lose_ranks  # a dead or stuck rank: leave the screen, then say why
    try:
        app.run()
    finally:
        rank.on_lost = None
    if app.failure:
        raise DistributedError(app.failure)
