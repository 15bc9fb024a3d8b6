"""`mlxspec generate`: one answer streamed to stdout, or one JSON object with its record."""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import click

from mlxspec.cli.errors import fail_cleanly
from mlxspec.cli.options import (
    NO_HISTORY_OPTION,
    PROPOSER_OPTION,
    TREE_OPTION,
    WEIGHTS_OPTION,
    answer_constraint,
    chat_template_args_option,
    grammar_options,
    kv_defaults,
    kv_options,
    model_option,
    prompt_cache_options,
    sampling_options,
)
from mlxspec.console import say, warn_if_slow_blas
from mlxspec.distributed.options import distributed_options
from mlxspec.events import Done
from mlxspec.registry.models_toml import load_registry
from tui.echo import COLOURS, AnswerEcho


@click.command()
@click.argument("prompt")
@model_option()
@PROPOSER_OPTION
@click.option("--max-tokens", "-n", type=click.IntRange(min=1), help="Most tokens to generate.")
@sampling_options
@click.option("--stop", multiple=True, help="Stop string (repeatable); not part of the output.")
@click.option(
    "--k", "fixed_k", type=click.IntRange(min=0), help="Fixed draft length (default: adaptive)."
)
@TREE_OPTION
@click.option("--chat/--raw", default=True, help="Apply the chat template (default) or not.")
@chat_template_args_option()
@grammar_options
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print one JSON object: the answer's text, reasoning and tool calls, and the run record.",
)
@click.option(
    "--color/--no-color",
    default=None,
    help="Colour accepted drafts and dim the reasoning (default: on a TTY).",
)
@NO_HISTORY_OPTION
@WEIGHTS_OPTION
@prompt_cache_options
@kv_options
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
    presence_penalty,
    frequency_penalty,
    seed,
    stop,
    fixed_k,
    tree,
    chat,
    chat_template_args,
    json_schema,
    regex,
    as_json,
    color,
    no_history,
    weights,
):
    """Generate an answer to PROMPT ('-' reads stdin), streaming it to stdout.

    A model that thinks (Qwen3's <think>...</think>) streams its reasoning to stderr,
    dimmed, and the answer alone to stdout.

    \b
    Examples:
      mlxspec generate "Summarise: ..." --proposer prompt-lookup
      mlxspec generate "Tell me about owls" --proposer head --tree --json
      echo "Rename x to count in: ..." | mlxspec generate - --json
      mlxspec generate "Repeat: a, b, c" --ranks 3 --json     # target sharded over 3 ranks
      mlxspec generate "Hi" -m qwen3-8b --chat-template-args '{"enable_thinking": false}'
      mlxspec generate "Invent a city" --json-schema city.schema.json
    """
    from mlxspec.decoding.engine import GenerationSettings
    from mlxspec.distributed.rank import current_rank
    from mlxspec.markup.conversation import Conversation
    from mlxspec.markup.display import PieceReader
    from mlxspec.registry.runtime import open_runtime
    from mlxspec.sampling import SamplingSettings
    from mlxspec.structured.answer import answer_grammar

    if prompt == "-":
        prompt = sys.stdin.read()
    if not prompt.strip():
        raise click.UsageError("the prompt is empty")
    constraint = answer_constraint(json_schema, regex)
    warn_if_slow_blas()
    registry = load_registry().including(model)
    registry = registry.with_defaults(
        weights=weights,
        chat_template_kwargs=chat_template_args,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        **kv_defaults(),
    )
    entry = registry.get(model)
    defaults = entry.defaults
    proposer_name = entry.proposer(proposer)  # validate before loading weights
    rank = current_rank()  # None unless launched with --ranks/--hostfile
    plain = proposer_name is None
    if rank:
        runtime = rank.open_runtime(entry, say)
    else:
        runtime = open_runtime(entry, notify=say, speculating=not plain)
    active = runtime.proposer(proposer_name.name if proposer_name else "none")
    settings = GenerationSettings(
        max_tokens=max_tokens or defaults.max_tokens,
        sampling=SamplingSettings(
            temperature=defaults.temperature if temperature is None else temperature,
            top_p=top_p or defaults.top_p,
            top_k=defaults.top_k if top_k is None else top_k,
            presence_penalty=defaults.presence_penalty,
            frequency_penalty=defaults.frequency_penalty,
            seed=seed,
        ),
        stop=stop,
        k=fixed_k,
        context=defaults.context,
        tree=defaults.tree if tree is None else tree,
        tree_nodes=defaults.tree_nodes,
        history=defaults.history and not no_history,
    )
    if chat:
        request = Conversation(
            [{"role": "user", "content": prompt}], None, dict(defaults.chat_template_kwargs)
        )
    else:
        request = prompt
    if constraint is not None:  # in the model's markup: its reasoning stays free
        settings = replace(
            settings, grammar=answer_grammar(runtime.engine.tokenizer, request, constraint)
        )
    reader = PieceReader(runtime.engine.tokenizer, request)
    echo = AnswerEcho(
        sys.stdout.isatty() if color is None else color,
        sys.stderr.isatty() if color is None else color,
    )
    finished = None
    stream = rank.stream if rank else lambda rt, *a: rt.engine.stream(*a)
    for event in stream(runtime, request, settings, active):
        if isinstance(event, Done):
            finished = reader.finish(event)
        elif type(event) in COLOURS:
            written = reader.read(event)
            if not as_json:
                echo.show(written.pieces)
    if rank and not rank.front:
        return  # rank 0 owns stdout
    if not rank:
        runtime.engine.save_prompts()  # a later run on the same prompt starts warm
    done, answer = finished.answered.done, finished.answered.answer
    if as_json:
        calls = [
            {"id": call.id, "name": call.name, "arguments": json.loads(call.arguments)}
            for call in answer.tool_calls
        ]
        click.echo(
            json.dumps(
                {
                    "text": answer.text,
                    "reasoning": answer.reasoning,
                    "tool_calls": calls,
                    "token_ids": list(done.token_ids),
                    "record": done.record.to_dict(),
                }
            )
        )
        return
    echo.show(finished.pieces)
    echo.end()
    record = done.record
    thought = f" ({record.reasoning_tokens} reasoning)" if record.reasoning_tokens else ""
    thought += " (thinking off)" if record.thinking == "off" else ""
    if record.grammar:  # forced tokens are drafts too, made by the grammar for free
        forced = f" ({record.grammar_accepted}/{record.grammar_drafted} forced by the grammar)"
    else:
        forced = ""
    say(
        f"{record.completion_tokens} tokens{thought}, {record.tokens_per_second:.1f} tok/s "
        f"({record.speedup_estimate.value:.2f}x plain), proposer {record.proposer}, "
        f"accepted {record.accepted}/{record.drafted} drafts{forced}, "
        f"finish: {record.finish_reason}"
    )
