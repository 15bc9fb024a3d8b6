"""`mlxspec serve`: the OpenAI-compatible API, batching requests that share a target."""

from __future__ import annotations

import click

from mlxspec.cli.errors import fail_cleanly
from mlxspec.cli.options import (
    MODEL_HELP,
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
from mlxspec.distributed.options import distributed_options
from mlxspec.registry.models_toml import load_registry

# `serve`: requests that share a target pass by default (docs/batching.md, measured).
# Measured: docs/batching.md (8 clients: 1.74x one at a time plain, 1.91x with prompt
# lookup), and sharded over 3 ranks docs/distributed.md (4 clients: 3.1x one at a time;
# 8 clients: --max-batch 8 >= 4).
DEFAULT_MAX_BATCH = 8

ROW_FLOOR_OPTION = click.option(
    "--row-floor",
    type=click.FloatRange(0.0, 1.0),
    help="Least share of its own plain speed a batched request keeps while the others' "
    "drafts widen the shared pass (default 0.95; 0: the batch's total tokens/s first). "
    "See docs/batching.md.",
)


@click.command()
@model_option("Model loaded at start and used when a request names none. " + MODEL_HELP)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(1, 65535))
@click.option(
    "--api-key",
    envvar="MLXSPEC_API_KEY",
    help="Require 'Authorization: Bearer KEY' or 'x-api-key: KEY' on /v1 (env: MLXSPEC_API_KEY).",
)
@click.option(
    "--allowed-hosts",
    default="",
    help="Comma-separated names a client may reach the server by besides the address it "
    "listens on (and localhost on loopback), e.g. 'mybox.lan' behind a LAN name or a proxy; "
    "'*': any. Other Host headers get 403 (DNS rebinding). See docs/serving.md.",
)
@click.option(
    "--cors-origins",
    default="",
    help="Comma-separated web origins whose pages may call the API from a browser, e.g. "
    "'http://localhost:3000' for a web UI; '*': any. Other Origin headers get 403.",
)
@click.option(
    "--max-waiting",
    default=None,
    type=click.IntRange(min=1),
    help="A cap on requests queued behind the running ones; more get 429 (default: no "
    "cap: the queue is bounded by --max-queue-wait and the memory its prompts hold).",
)
@click.option(
    "--max-queue-wait",
    default=300.0,
    show_default=True,
    type=click.FloatRange(min=0),
    help="Seconds a request may expect to wait in line, at the pace the model keeps; a "
    "request that would wait longer gets 429 with Retry-After.",
)
@click.option(
    "--max-tokens-limit",
    default=4096,
    show_default=True,
    type=click.IntRange(min=1),
    help="Largest max_tokens a request gets: a request asking for more (agents ask for "
    "32000) is granted this, and never more than the model's context leaves.",
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
@click.option(
    "--shutdown-timeout",
    default=5.0,
    show_default=True,
    type=click.FloatRange(min=0),
    help="On SIGINT, SIGTERM or SIGHUP: seconds running requests get to finish before they "
    "end with a 503; then the server exits 0.",
)
@chat_template_args_option(
    "Extra arguments of the chat template for every model, a JSON object, e.g. "
    "'{\"enable_thinking\": false}' (default: the model's `chat_template_kwargs`); a "
    "request's chat_template_kwargs win key by key."
)
@TREE_OPTION
@WEIGHTS_OPTION
@prompt_cache_options
@kv_options
@penalty_options
@distributed_options
@fail_cleanly
def serve(
    model,
    host,
    port,
    api_key,
    allowed_hosts,
    cors_origins,
    max_waiting,
    max_queue_wait,
    max_tokens_limit,
    max_batch,
    row_floor,
    kv_memory,
    shutdown_timeout,
    chat_template_args,
    tree,
    weights,
    presence_penalty,
    frequency_penalty,
):
    """Serve OpenAI's and Anthropic's APIs: /v1/chat/completions, /v1/completions,
    /v1/responses (Codex), /v1/messages (Claude Code), /v1/models; Ollama's
    (/api/chat, /api/generate with suffix, /api/tags...: --port 11434 for editors);
    and llama.cpp's /infill and /completion (llama.vim, llama.vscode: --port 8012).

    Up to --max-batch requests (default 8, sharded too) share each target pass; the
    others wait in line (bounded by --max-queue-wait; beyond it, 429 with Retry-After).
    Requests may name any registry model (one is in memory at a time) and pass
    {"mlxspec": {"proposer": ..., "k": ..., "tree": ..., "history": false, "provenance":
    true}}; answers carry the run record as x_mlxspec. Chat requests may pass tools
    (OpenAI's function tools; calls come back as tool_calls) and chat_template_kwargs;
    reasoning comes back as reasoning_content.

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
    from mlxspec.server.origin_guard import is_loopback

    registry = load_registry().including(model)
    registry = registry.with_defaults(
        tree=tree,
        weights=weights,
        chat_template_kwargs=chat_template_args,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        **kv_defaults(),
    )
    max_batch = max_batch or DEFAULT_MAX_BATCH
    rank = current_rank()  # None unless launched with --ranks/--hostfile
    if rank is None:
        from mlxspec.registry.runtime import check_before_loading

        provider = RegistryProvider(registry, default=model, notify=say)
        check_before_loading(registry.get(provider.default))  # refused before it loads
    else:
        entry = registry.get(model)
        if not rank.front:  # the other ranks run what rank 0's server announces
            rank.follow(rank.open_runtime(entry, say, follows=True), max_batch)  # replay its batch
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
        max_queue_wait=max_queue_wait,
        max_batch=max_batch,
        row_floor=ROW_FLOOR if row_floor is None else row_floor,
        kv_memory=kv_memory,
    )
    hosts = _listed(allowed_hosts) + ([] if _unspecified(host) else [host])
    app = create_app(
        provider,
        api_key=api_key,
        limits=limits,
        preload=provider.default,
        ranks=rank,
        allowed_hosts=hosts,
        cors_origins=_listed(cors_origins),
    )
    if not is_loopback(host) and not api_key:
        say(
            f"warning: listening on {host} without --api-key: anyone who can reach this "
            "address can run prompts on this machine and read stored responses"
        )
    say(f"serving {provider.default} at http://{host}:{port}/v1")
    run_server(app, host, port, sock, shutdown_timeout)


def _listed(option: str) -> list[str]:
    """'a, b,' -> ['a', 'b']."""
    return [item.strip() for item in option.split(",") if item.strip()]


def _unspecified(host: str) -> bool:
    """0.0.0.0 or ::, every address of the machine: no name a client would send."""
    return host.strip("[]") in ("0.0.0.0", "::", "")
