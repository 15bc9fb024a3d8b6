"""`mlxspec bench`: timed rows side by side (sharded with --ranks), `--concurrency`
against the in-process server, or `--from-history` over saved chats."""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from pathlib import Path

import click

# Only the suite names, for --help; the bench itself is imported when it runs.
from mlxspec.bench.suites import SUITES
from mlxspec.cli.errors import fail_cleanly
from mlxspec.cli.options import WEIGHTS_OPTION, model_option
from mlxspec.console import say, warn_if_slow_blas
from mlxspec.distributed.options import distributed_options
from mlxspec.registry.models_toml import load_registry


class DraftLength(click.ParamType):
    """A draft length: a whole number of tokens (1 or more), or 'adaptive' (None)."""

    name = "k"

    def convert(self, value, param, ctx):
        if value is None or value == "adaptive":
            return None
        try:
            k = int(value)
        except (TypeError, ValueError):
            k = 0
        if k < 1:
            self.fail(
                f"{value!r} is neither a draft length of 1 or more nor 'adaptive'", param, ctx
            )
        return k


DRAFT_LENGTH = DraftLength()


@click.command()
@model_option()
@click.option(
    "--suite",
    type=click.Choice(SUITES),
    help="Prompt suite (default: quick; with --concurrency: all, a mix of every class).",
)
@click.option(
    "--prompts",
    "prompts_file",
    type=click.Path(dir_okay=False),
    help='Your own JSONL instead of a suite: {"prompt": ..., "class": ...} a line.',
)
@click.option(
    "--replay",
    is_flag=True,
    help="Run the --prompts file in order, each method with its own history building up "
    "from one request to the next (as the agent suite); default methods: plain, "
    "prompt-lookup, suffix.",
)
@click.option(
    "--proposers",
    help="Comma-separated methods, e.g. 'core,prompt-lookup@k=8' ('core': plain-mlx-lm, "
    "mlx-lm-speculative, none, the default proposer, draft-model@k=3; 'all': core plus every "
    "proposer; default: core for quick, else all).",
)
@click.option(
    "--max-tokens",
    "-n",
    default=128,
    show_default=True,
    type=click.IntRange(min=1),
    help="Most tokens per answer.",
)
@click.option(
    "--repeats",
    "-r",
    type=click.IntRange(min=1),
    help="Timed runs of each prompt and method (default: 1 for quick, else 3).",
)
@click.option(
    "--json", "json_path", type=click.Path(dir_okay=False), help="Write machine, rows and summary."
)
@click.option(
    "--markdown", "markdown_path", type=click.Path(dir_okay=False), help="Write the tables."
)
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False),
    help="PNG of speedup per prompt class (needs the 'plot' extra).",
)
@click.option(
    "--from-history",
    "history",
    is_flag=True,
    help="Estimate each proposer's acceptance on your saved chats instead (fast, no timing).",
)
@click.option(
    "--tree/--no-tree",
    default=None,
    help="--tree: beside every speculative mlxspec row, the same proposer verifying draft "
    "trees (NAME@tree); --no-tree: lines only.",
)
@click.option(
    "--concurrency",
    "-c",
    multiple=True,
    type=click.IntRange(min=1, max=64),
    help="N clients at once against the in-process server: one at a time vs batched (plain "
    "and each proposer in --proposers, names only) vs mlx-lm's batch_generate. Repeatable.",
)
@click.option(
    "--row-floor",
    "row_floors",
    multiple=True,
    type=click.FloatRange(0.0, 1.0),
    help="With --concurrency: the batched proposer rows at this serve --row-floor "
    "(default: serve's, 0.95). Repeatable, to compare floors in one run.",
)
@WEIGHTS_OPTION
@click.option(
    "--synthetic-acceptance",
    "acceptances",
    multiple=True,
    type=click.FloatRange(0.0, 1.0),
    help="The engine alone, at a known acceptance A: the target's own next tokens drafted, "
    "each corrupted with probability 1 - A, measured speedup beside what the verify-cost "
    "curve predicts. Repeatable.",
)
@click.option(
    "--k",
    "draft_lengths",
    multiple=True,
    type=DRAFT_LENGTH,
    help="With --synthetic-acceptance: draft length, a number or 'adaptive'. Repeatable "
    "(default: 4, 8 and adaptive).",
)
@distributed_options
@fail_cleanly
def bench(
    model,
    suite,
    prompts_file,
    replay,
    proposers,
    max_tokens,
    repeats,
    json_path,
    markdown_path,
    plot_path,
    history,
    tree,
    concurrency,
    row_floors,
    weights,
    acceptances,
    draft_lengths,
):
    """Side by side, same prompts, greedy: mlx-lm, mlx-lm's speculative decoding, mlxspec.

    Prints a table (tokens/s after the first round, time to first token, acceptance,
    speedup vs plain-mlx-lm, and whether the tokens equal plain-mlx-lm's) and a
    per-class summary. Methods are interleaved per prompt so machine noise hits all.

    \b
    Examples:
      mlxspec bench --suite quick
      mlxspec bench --suite all --json bench.json --markdown bench.md --plot bench.png
      mlxspec bench --prompts mine.jsonl --proposers prompt-lookup,prompt-lookup@k=8
      mlxspec bench --prompts my-stream.jsonl --replay   # history builds up, as for an agent
      mlxspec bench --suite chat --proposers head,medusa,lookahead --tree   # line vs tree
      mlxspec bench --from-history --json history.json
      mlxspec bench --concurrency 4 --concurrency 8 --proposers prompt-lookup
      mlxspec bench -c 8 --proposers prompt-lookup --row-floor 0.95 --row-floor 0
      mlxspec bench --ranks 3 --proposers prompt-lookup   # every row on the sharded target
      mlxspec bench --synthetic-acceptance 0.9 --k 8      # engine overhead at a known A
    """
    from mlxspec.bench import BenchError
    from mlxspec.bench.report import markdown
    from mlxspec.bench.session import Interrupted, execute, plan, write_outputs
    from mlxspec.distributed.rank import current_rank
    from mlxspec.registry.runtime import open_runtime

    rank = current_rank()  # None unless launched with --ranks/--hostfile
    if rank is not None and (concurrency or history):
        raise click.UsageError(
            "--ranks/--hostfile runs the timed bench only; leave out --concurrency and "
            "--from-history"
        )
    notify = rank.notify(say) if rank else say

    def progress(index, total, prompt, method):
        notify(f"[{index + 1}/{total}] {prompt.id} ({prompt.kind}): {method.name}")

    entry = load_registry().including(model).with_defaults(weights=weights).get(model)
    warn_if_slow_blas()
    if row_floors and not concurrency:
        raise click.UsageError("--row-floor goes with --concurrency")
    if draft_lengths and not acceptances:
        raise click.UsageError("--k goes with --synthetic-acceptance")
    if acceptances:
        if rank is not None or concurrency or history or tree or plot_path or replay or proposers:
            raise click.UsageError(
                "--synthetic-acceptance runs its own proposer in one process; leave out "
                "--proposers, --concurrency, --from-history, --tree, --plot, --replay and --ranks"
            )
        outputs = (json_path, markdown_path)
        lengths = tuple(dict.fromkeys(draft_lengths)) or None
        _bench_synthetic(
            entry, suite, prompts_file, max_tokens, repeats or 1, acceptances, lengths, outputs
        )
        return
    if concurrency:
        if history or tree or plot_path or replay:
            raise click.UsageError(
                "--concurrency draws no plot and runs lines only; leave out "
                "--from-history, --tree, --plot and --replay"
            )
        levels = list(concurrency)
        outputs = (json_path, markdown_path)
        _bench_concurrency(
            entry,
            suite,
            prompts_file,
            proposers,
            max_tokens,
            levels,
            repeats or 1,
            outputs,
            row_floors,
        )
        return
    suite = suite or "quick"
    if history:
        from mlxspec.bench.history import history_markdown, replay_history
        from tui.store import conversations_dir

        try:
            result = replay_history(open_runtime(entry, notify=say), conversations_dir(), say)
        except BenchError as err:
            raise click.ClickException(str(err)) from None
        click.echo(history_markdown(result))
        if json_path:
            Path(json_path).write_text(json.dumps(result, indent=2))
        return
    try:
        # Everything checkable is checked before the weights load.
        plot = plot_path is not None and (rank is None or rank.front)
        request = plan(
            entry,
            suite,
            prompts_file,
            proposers,
            max_tokens,
            repeats,
            plot,
            tree,
            rank is not None,
            replay,
        )
        if request.left_out:
            notify(f"left out {', '.join(request.left_out)}: a sharded target verifies lines only")
        if rank is None:
            result = execute(request, open_runtime(entry, notify=say), say, progress)
        else:
            runtime = rank.open_runtime(entry, say)
            sharded = (rank.setup(), partial(rank.run, runtime))
            result = execute(request, runtime, notify, progress, sharded)
            if not rank.front:
                return  # rank 0 prints and writes
        click.echo(markdown(result))
        written = write_outputs(result, json_path, markdown_path, plot_path)
    except Interrupted as stop:
        if rank is not None and not rank.front:
            raise click.ClickException(str(stop)) from None
        click.echo(markdown(stop.result))
        raise click.ClickException(f"{stop}; the rows above are partial") from None
    except BenchError as err:
        raise click.ClickException(str(err)) from None
    if written:
        say(f"wrote {', '.join(map(str, written))}")


def _bench_synthetic(
    entry, suite, prompts_file, max_tokens, repeats, acceptances, lengths, outputs
) -> None:
    """`bench --synthetic-acceptance`: see mlxspec/bench/synthetic.py."""
    from mlxspec.bench import BenchError
    from mlxspec.bench.suites import load_suite, read_prompts
    from mlxspec.bench.synthetic import DRAFT_LENGTHS, run_synthetic, synthetic_markdown
    from mlxspec.registry.runtime import open_runtime

    try:
        prompts = read_prompts(Path(prompts_file)) if prompts_file else load_suite(suite or "quick")
    except BenchError as err:
        raise click.ClickException(str(err)) from None
    runtime = open_runtime(entry, notify=say)
    result = run_synthetic(
        runtime, prompts, max_tokens, repeats, say, tuple(acceptances), lengths or DRAFT_LENGTHS
    )
    settings = _settings(entry, prompts, max_tokens, repeats)
    settings["weights"] = runtime.loaded.weights_dtype
    _show(result, settings, synthetic_markdown, outputs)


def _bench_concurrency(
    entry, suite, prompts_file, proposers, max_tokens, levels, repeats, outputs, row_floors
) -> None:
    """`bench --concurrency`: see mlxspec/bench/concurrency.py."""
    from mlxspec.batch.width import ROW_FLOOR
    from mlxspec.bench import BenchError
    from mlxspec.bench.concurrency import concurrency_markdown, run_concurrency
    from mlxspec.bench.suites import load_suite, read_prompts
    from mlxspec.registry.runtime import ProposerError, open_runtime

    try:
        prompts = read_prompts(Path(prompts_file)) if prompts_file else load_suite(suite or "all")
        names = proposers.split(",") if proposers else list(entry.proposer_names)
        for name in names:
            entry.proposer(name.strip())  # an unknown name fails here, before the weights load
        runtime = open_runtime(entry, notify=say)
        names = [n.strip() for n in names]
        floors = tuple(dict.fromkeys(row_floors)) or (ROW_FLOOR,)  # each floor once
        result = run_concurrency(runtime, prompts, levels, names, max_tokens, say, repeats, floors)
    except (BenchError, ProposerError) as err:
        raise click.ClickException(str(err)) from None
    _show(result, _settings(entry, prompts, max_tokens, repeats), concurrency_markdown, outputs)


def _settings(entry, prompts: list, max_tokens: int, repeats: int) -> dict:
    """What a bench ran with, for its JSON."""
    return {
        "model": entry.name,
        "prompts": len(prompts),
        "max_tokens": max_tokens,
        "repeats": repeats,
    }


def _show(
    result: dict,
    settings: dict,
    render: Callable[[dict], str],
    outputs: tuple[str | None, str | None],
) -> None:
    """Stamp a bench's result with the machine and its settings, print its table (`render`),
    and write the result as JSON and the table as markdown where `--json` and `--markdown`
    asked."""
    from mlxspec.bench.machine import describe_machine

    result.update(machine=describe_machine(), settings=settings)
    table = render(result)
    click.echo(table)
    json_path, markdown_path = outputs
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2))
    if markdown_path:
        Path(markdown_path).write_text(table + "\n")
