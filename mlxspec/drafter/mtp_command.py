"""The `--mtp` part of `mlxspec pull`: pull a model's MTP layer and register it."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from mlxspec.console import say
from mlxspec.drafter.mtp_pull import mtp_folder, pull_mtp
from mlxspec.models.loading import fetch_weights
from mlxspec.models.packaged import PullError, is_packaged
from mlxspec.registry.models_toml import ModelEntry
from mlxspec.registry.register import register_proposer

PROPOSER = "mtp"


def target_quantization(target: str) -> dict | None:
    """The target's quantization settings (group_size, bits), None when it is float."""
    path = fetch_weights(target, progress=False)
    config = path / "config.json" if path.is_dir() else None
    if config is None or not config.is_file():
        return None  # a GGUF file: the MTP layer is kept in float
    return json.loads(config.read_text()).get("quantization")


def entry_name(reference: str) -> str:
    """A models.toml name for a model named by hub id or path: its last part."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", Path(reference).name).strip("-._").lower() or "model"


def pull_and_register_mtp(
    name: str, entry: ModelEntry | None, target: str, source: str | None
) -> Path:
    """Pull the MTP layer of `target` from `source` (default: the entry's mtp source,
    else the target itself) and register it as proposer 'mtp'; where it was saved."""
    configured = entry.proposers.get(PROPOSER) if entry is not None else None
    if source is None and configured is not None and configured.kind == PROPOSER:
        source = configured.options.get("source")
    source = source or target
    if is_packaged(source) or source.lower().endswith(".gguf"):
        raise PullError(
            f"{source} is a GGUF file, which keeps no MTP layer; pass the original "
            "checkpoint with --from (a hub repo id or a folder with safetensors)"
        )
    destination = mtp_folder(target)
    say(f"fetching the MTP layer of {target} from {source}")
    keys = pull_mtp(source, destination, target_quantization(target), say)
    say(f"saved {len(keys)} MTP tensors in {destination}")
    options = {"kind": PROPOSER, "path": str(destination), "source": source}
    note = f"added by mlxspec pull --mtp on {time.strftime('%Y-%m-%d %H:%M')}"
    if entry is not None and entry.source is not None:
        path = register_proposer(entry.name, PROPOSER, options, note)
        registered = entry.name
    else:  # a hub id or path: a new entry of its own, drafting with its MTP layer
        registered = entry_name(name)
        resolved = str(Path(target).expanduser().absolute()) if Path(target).exists() else target
        path = register_proposer(registered, PROPOSER, options, note, target=resolved)
    say(
        f"registered as proposer 'mtp' of '{registered}' in {path}; try: "
        f"mlxspec chat --model {registered} --proposer mtp"
    )
    return destination
