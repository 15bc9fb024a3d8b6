"""`mlxspec` command line: the group; each command lives in a module of its own.

Every failure the user can cause ends as one `Error: ...` line and a non-zero exit
(`errors.fail_cleanly`); progress and diagnostics go to stderr so stdout carries only
the answer (or JSON). Options several commands share are declared once in `options`.
"""

from __future__ import annotations

import click

import mlxspec  # OpenBLAS before mlx.core
from mlxspec.cli import bench, cache, chat, generate, models, serve, train


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(mlxspec.__version__, prog_name="mlxspec")
def main() -> None:
    """Lossless speculative decoding on MLX.

    \b
    Example:
      mlxspec generate "Repeat after me: the quick brown fox"
    """
    from mlxspec.registry.prompt_store import reset_plan

    reset_plan()  # before the command's own options set it


for command in (
    generate.generate,
    chat.chat,
    models.models,
    models.history,
    models.pull,
    cache.cache,
    serve.serve,
    bench.bench,
    train.train_drafter,
):
    main.add_command(command)
