"""Options that several commands share, declared once (`--ranks` and friends live in
`mlxspec.distributed.options`, beside the launch they drive)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from mlxspec.decoding.weights_choice import CHOICES as WEIGHT_CHOICES
from mlxspec.decoding.weights_choice import ENV_VAR as WEIGHTS_ENV
from mlxspec.structured.grammar import Grammar

MODEL_HELP = (
    "A models.toml entry (`mlxspec models`), a hub repo id (owner/name) or a local "
    "mlx-lm folder or .gguf file (default: the registry's default)."
)


def model_option(help: str = MODEL_HELP):
    """`--model/-m`; serve and train-drafter say more about what the model is for."""
    return click.option("--model", "-m", help=help)


CHAT_TEMPLATE_ARGS_HELP = (
    "Extra arguments of the chat template, a JSON object, e.g. "
    "'{\"enable_thinking\": false}' (default: the model's `chat_template_kwargs`)."
)


def chat_template_args_option(help: str = CHAT_TEMPLATE_ARGS_HELP):
    """`--chat-template-args JSON`, read into a dict; serve says it holds for every model."""
    return click.option("--chat-template-args", callback=_template_args, metavar="JSON", help=help)


def _template_args(ctx: click.Context, param: click.Parameter, text: str | None) -> dict | None:
    """--chat-template-args: a JSON object, or one line saying what is wrong with it."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise click.ClickException(f"--chat-template-args is not valid JSON: {err}") from None
    if not isinstance(value, dict):
        raise click.ClickException(
            f"--chat-template-args must be a JSON object, e.g. '{{\"enable_thinking\": false}}', "
            f"got {text}"
        )
    return value


PROPOSER_OPTION = click.option(
    "--proposer", "-p", help="Proposer of that entry, or 'none' for plain decoding."
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

WEIGHTS_OPTION = click.option(
    "--weights",
    type=click.Choice(WEIGHT_CHOICES),
    envvar=WEIGHTS_ENV,
    help="quantized: keep the weights as stored (what Metal runs); dequantized: float32; "
    "auto: by device (env: MLXSPEC_WEIGHTS; default: the model's `weights`, else auto).",
)

JSON_OPTION = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")


def bundle(*options):
    """One decorator for several options, listed in --help in the order given."""

    def decorate(func):
        for option in reversed(options):
            func = option(func)
        return func

    return decorate


# OpenAI's penalties with mlx-lm's window (mlxspec/sampling.py); the model's default
# (models.toml) when not given. On serve and chat they replace every model's default.
penalty_options = bundle(
    click.option(
        "--presence-penalty",
        type=click.FloatRange(-2, 2),
        help="OpenAI's presence penalty, over the last 20 tokens (default: the model's).",
    ),
    click.option(
        "--frequency-penalty",
        type=click.FloatRange(-2, 2),
        help="OpenAI's frequency penalty, over the last 20 tokens (default: the model's).",
    ),
)
sampling_options = bundle(
    click.option("--temperature", "-t", type=click.FloatRange(min=0), help="0 = greedy."),
    click.option(
        "--top-p", type=click.FloatRange(min=0, max=1, min_open=True), help="Nucleus mass."
    ),
    click.option("--top-k", type=click.IntRange(min=0), help="Keep the k likeliest tokens."),
    penalty_options,
    click.option("--seed", type=int, help="Seed for sampling (the record shows the one used)."),
)


def _schema_file(ctx: click.Context, param: click.Parameter, path: str | None) -> Grammar | None:
    """--json-schema FILE: the schema as a grammar, checked before any model loads (one
    line naming the file and what is wrong with it otherwise)."""
    if path is None:
        return None
    said = f"--json-schema {path}"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise click.ClickException(f"{said}: cannot read it: {err.strerror or err}") from None
    except UnicodeDecodeError:
        raise click.ClickException(f"{said}: not a JSON file (not UTF-8 text)") from None
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as err:
        raise click.ClickException(f"{said}: not valid JSON: {err}") from None
    if not isinstance(schema, dict):
        raise click.ClickException(
            f"{said}: a JSON schema is a JSON object, this file holds a {type(schema).__name__}"
        )
    return _checked(said, Grammar.json_schema(schema))


def _regex(ctx: click.Context, param: click.Parameter, pattern: str | None) -> Grammar | None:
    """--regex PATTERN: the pattern as a grammar, or one line saying why it cannot be one."""
    return None if pattern is None else _checked("--regex", Grammar("regex", pattern))


def _checked(said: str, grammar: Grammar) -> Grammar:
    """`grammar`, once llguidance can compile it (no tokenizer needed: no model loads)."""
    from mlxspec.structured.answer import grammar_problem

    problem = grammar_problem(grammar)
    if problem is not None:
        raise click.ClickException(f"{said}: {problem}")
    return grammar


# Structured output for generate: the answer (after any reasoning) must match; the two
# are one choice, so `answer_constraint` refuses both at once.
grammar_options = bundle(
    click.option(
        "--json-schema",
        metavar="FILE",
        callback=_schema_file,
        help="Answer with JSON valid against the JSON schema in FILE.",
    ),
    click.option(
        "--regex",
        metavar="PATTERN",
        callback=_regex,
        help="Answer with text that matches PATTERN in full.",
    ),
)


def answer_constraint(json_schema: Grammar | None, regex: Grammar | None):
    """The AnswerConstraint of --json-schema / --regex (None: free text)."""
    from mlxspec.structured.answer import AnswerConstraint

    if json_schema is not None and regex is not None:
        raise click.ClickException("--json-schema and --regex cannot be used together")
    grammar = json_schema or regex
    return None if grammar is None else AnswerConstraint(grammar=grammar)


def _plan_memory(ctx: click.Context, param: click.Parameter, text: str | None) -> None:
    from mlxspec.registry.prompt_store import PLAN, parse_size

    if text is not None:
        try:
            PLAN.memory_bytes = parse_size(text)
        except ValueError as err:
            raise click.BadParameter(str(err)) from None


def _plan_folder(ctx: click.Context, param: click.Parameter, folder: str | None) -> None:
    from mlxspec.registry.prompt_store import PLAN

    if folder is not None:
        PLAN.folder = folder


def _plan_no_folder(ctx: click.Context, param: click.Parameter, off: bool) -> None:
    from mlxspec.registry.prompt_store import PLAN

    if off:
        PLAN.folder = None


def _kv_choice(ctx: click.Context, param: click.Parameter, value: int | None) -> None:
    if value is not None:
        ctx.meta.setdefault("mlxspec.kv", {})[param.name] = value


def kv_defaults() -> dict:
    """The KV form the command line gave (`--kv-bits` and friends), as models.toml
    defaults: `Registry.with_defaults(**kv_defaults())`."""
    return dict(click.get_current_context().meta.get("mlxspec.kv", {}))


# The KV cache's form (mlxspec/models/kv_form.py, docs/memory.md), mlx-lm's server's names.
kv_options = bundle(
    click.option(
        "--kv-bits",
        type=click.Choice(["4", "8"]),
        callback=lambda ctx, param, v: _kv_choice(ctx, param, None if v is None else int(v)),
        expose_value=False,
        help="Hold the KV cache quantized to 4 or 8 bits (default: float, or the model's "
        "`kv_bits`); a batch of several requests keeps float KV.",
    ),
    click.option(
        "--kv-group-size",
        type=click.Choice(["32", "64", "128"]),
        callback=lambda ctx, param, v: _kv_choice(ctx, param, None if v is None else int(v)),
        expose_value=False,
        help="Values per quantization group of the KV cache (default 64).",
    ),
    click.option(
        "--quantized-kv-start",
        type=click.IntRange(min=0),
        callback=_kv_choice,
        expose_value=False,
        help="Position from which the KV cache is quantized (default 0: all of it).",
    ),
)


# Earlier prompts' caches, kept for the next request that starts the same way
# (mlxspec/registry/prompt_store.py, docs/serving.md): the options only set the process's plan.
prompt_cache_options = bundle(
    click.option(
        "--prompt-cache-bytes",
        callback=_plan_memory,
        expose_value=False,
        metavar="SIZE",
        help="Memory earlier prompts' caches may keep, e.g. 4GB (0: none; default: an "
        "eighth of the device's memory; a batch's rows take room from it first).",
    ),
    click.option(
        "--prompt-cache-dir",
        callback=_plan_folder,
        expose_value=False,
        type=click.Path(file_okay=False),
        help="Where prompt caches outlive the process (default: the cache dir's "
        "prompt-cache/, env MLXSPEC_PROMPT_CACHE_DIR; `mlxspec cache` lists and clears it).",
    ),
    click.option(
        "--no-prompt-cache-dir",
        is_flag=True,
        callback=_plan_no_folder,
        expose_value=False,
        help="Keep prompt caches in memory only.",
    ),
)
