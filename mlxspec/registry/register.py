"""Writing the user's models.toml: a drafter trained or pulled here becomes a proposer.

Reading and checking models.toml is `registry`'s job; this module only adds to the user's
file, and has `registry` check the result before it is kept.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mlxspec.registry.models_toml import (
    SHIPPED_FILE,
    parse_registry_file,
    parse_registry_text,
    table_header,
    user_file_path,
)


def register_proposer(
    model: str,
    proposer: str,
    options: Mapping[str, Any],
    note: str,
    target: str | None = None,
) -> Path:
    """Add (or replace) `[models.MODEL.proposers.PROPOSER]` in the user's models.toml.

    Written as an extension of the entry (no target), so the shipped entry keeps its
    other proposers; with `target`, as a whole new entry drafting with it by default.
    The result is validated before it is kept.
    """
    path = user_file_path()
    old = path.read_text(encoding="utf-8") if path.is_file() else ""
    header = table_header(model, "proposers", proposer)
    replaced = {header, table_header(model)} if target is not None else {header}
    kept, skipping = [], False
    for line in old.splitlines():
        stripped = line.strip()
        if stripped.startswith("["):
            skipping = stripped in replaced
        if not skipping:
            kept.append(line)
    body = "\n".join(f"{key} = {json.dumps(value)}" for key, value in options.items())
    if target is not None:
        entry = {"target": target, "default_proposer": proposer}
        lines = "\n".join(f"{key} = {json.dumps(value)}" for key, value in entry.items())
        header = f"{table_header(model)}\n{lines}\n\n{header}"
    new = "\n".join(kept).rstrip() + f"\n\n# {note}\n{header}\n{body}\n"
    parse_registry_text(new.lstrip(), path, parse_registry_file(SHIPPED_FILE)[0])  # raises if wrong
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(new.lstrip(), encoding="utf-8")
    tmp.replace(path)
    return path
