"""`mlxspec` command line: generate, models, pull (chat, serve and bench live beside).

Every failure the user can cause ends as one `Error: ...` line and a non-zero exit;
progress and diagnostics go to stderr so stdout carries only the answer (or JSON).
"""

from __future__ import annotations

import json
import sys

import click

import mlxspec  # noqa: F401  (OpenBLAS before mlx.core)
from mlxspec import device
from mlxspec.events import Accepted, Bonus, Corrected, Done
from mlxspec.registry import RegistryError, load_registry

COLOURS = {Accepted: "green", Corrected: None, Bonus: None}


def say(message: str) -> None:
    click.echo(f"mlxspec: {message}", err=True)


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
@click.option("--model", "-m", help="Entry in models.toml (default: the registry's default).")
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
@click.option("--chat/--raw", default=True, help="Apply the chat template (default) or not.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with the run record.")
@click.option(
    "--color/--no-color", default=None, help="Colour accepted drafts (default: on a TTY)."
)
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
    chat,
    as_json,
    color,
):
    """Generate an answer to PROMPT ('-' reads stdin), streaming it to stdout.

    \b
    Examples:
      mlxspec generate "Summarise: ..." --proposer prompt-lookup
      echo "Rename x to count in: ..." | mlxspec generate - --json
    """
    from mlxspec.engine import GenerationSettings
    from mlxspec.runtime import open_runtime
    from mlxspec.sampling import SamplingSettings

    if prompt == "-":
        prompt = sys.stdin.read()
    if not prompt.strip():
        raise click.UsageError("the prompt is empty")
    entry = load_registry().get(model)
    defaults = entry.defaults
    proposer_name = entry.proposer(proposer)  # validate before loading weights
    runtime = open_runtime(entry, notify=say)
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
    )
    request = [{"role": "user", "content": prompt}] if chat else prompt
    colour = sys.stdout.isatty() if color is None else color
    done = None
    for event in runtime.engine.stream(request, settings, active):
        if isinstance(event, Done):
            done = event
        elif not as_json and type(event) in COLOURS:
            style = COLOURS[type(event)] if colour else None
            click.echo(click.style(event.text, fg=style) if style else event.text, nl=False)
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
        f"{record.completion_tokens} tokens, {record.tokens_per_second:.1f} tok/s, proposer "
        f"{record.proposer}, accepted {record.accepted}/{record.drafted} drafts, "
        f"finish: {record.finish_reason}"
    )


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
@click.argument("name")
@fail_cleanly
def pull(name):
    """Download the weights of a registry entry (target and draft models).

    \b
    Example:
      mlxspec pull smollm2-135m
    """
    from mlxspec.loading import load_model

    entry = load_registry().get(name)
    references = [entry.target] + [
        p.options["draft"] for p in entry.proposers.values() if p.kind == "draft-model"
    ]
    for reference in dict.fromkeys(references):
        say(f"fetching {reference}")
        load_model(reference, progress=True)
    say(f"{name}: ready")
