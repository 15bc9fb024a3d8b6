"""Where a loaded model keeps its prompt caches: how many bytes in memory, which folder
on disk and how many bytes there (`--prompt-cache-bytes`, `--prompt-cache-dir`,
`--no-prompt-cache-dir`, `MLXSPEC_PROMPT_CACHE_DIR`), for every runtime this process
opens.

The disk folder's key is everything a cache's values depend on: the entry, the weights
it was loaded from, their form in memory, the device and mlx's version. A cache from
other weights, or rounded by another build, is never handed to this one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from mlxspec import device
from mlxspec.batch.memory import GB, prompt_cache_bytes
from mlxspec.models.prompt_cache import PromptCache
from mlxspec.models.prompt_disk import DiskCache
from mlxspec.paths import cache_dir

FOLDER_ENV = "MLXSPEC_PROMPT_CACHE_DIR"  # a folder, or "off"
DISK_BYTES = 16 * GB  # the disk tier's default bound


@dataclass
class PromptCachePlan:
    memory_bytes: int | None = None  # None: a share of the device's memory
    folder: Path | None | str = "default"  # "default": FOLDER_ENV, else the cache dir's
    disk_bytes: int = DISK_BYTES


PLAN = PromptCachePlan()  # set by the command's options (`reset_plan` before each command)


def reset_plan() -> None:
    """The defaults again (a command run in-process after another starts from them)."""
    fresh = PromptCachePlan()
    PLAN.memory_bytes, PLAN.folder, PLAN.disk_bytes = (
        fresh.memory_bytes,
        fresh.folder,
        fresh.disk_bytes,
    )


def prompt_folder(plan: PromptCachePlan | None = None) -> Path | None:
    """The folder the plan writes to (None: no disk tier)."""
    plan = plan or PLAN
    if plan.folder != "default":
        return None if plan.folder is None else Path(plan.folder)
    named = os.environ.get(FOLDER_ENV)
    if named:
        return None if named == "off" else Path(named)
    return cache_dir() / "prompt-cache"


def disk_key(name: str, target: str, held: str) -> str:
    facts = device.describe()
    return f"{name}|{target}|{held}|{facts['device']}|mlx {mx.__version__}"


def prompt_cache_for(name: str, target: str, held: str, plan: PromptCachePlan | None = None):
    """A runtime's pool, with its disk tier where the plan has one."""
    plan = plan or PLAN
    folder = prompt_folder(plan)
    disk = None
    if folder is not None and plan.disk_bytes > 0:
        disk = DiskCache(folder, disk_key(name, target, held), plan.disk_bytes)
    return PromptCache(max_bytes=prompt_cache_bytes(plan.memory_bytes), disk=disk)


def parse_size(text: str) -> int:
    """'8GB', '512M', '1.5G', '1000000' -> bytes (binary units)."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    cleaned = text.strip().upper().removesuffix("B").removesuffix("I")
    number, unit = cleaned, ""
    if cleaned and cleaned[-1] in units:
        number, unit = cleaned[:-1], cleaned[-1]
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"not a size: {text!r} (e.g. 8GB, 512MB, 0 for none)") from None
    if value < 0:
        raise ValueError(f"a size must not be negative: {text!r}")
    return int(value * units[unit])
