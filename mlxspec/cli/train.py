"""`mlxspec train-drafter`: train a drafter for a model on this machine, and register it."""

from __future__ import annotations

from pathlib import Path

import click

from mlxspec.cli.errors import fail_cleanly
from mlxspec.cli.options import model_option
from mlxspec.console import say
from mlxspec.drafter.prompts import DEFAULT_PROMPTS, TRAINING_PROMPTS
from mlxspec.registry.models_toml import load_registry


@click.command("train-drafter")
@model_option("Entry in models.toml whose target the drafter drafts for.")
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
    help="Proposer name to register it under (default: the kind's own: head, distilled, "
    "self-spec-exit, medusa or block).",
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
    from mlxspec.models.loading import load_model

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
