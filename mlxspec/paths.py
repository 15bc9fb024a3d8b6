"""Where mlxspec keeps downloads, user config and saved conversations (XDG layout)."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def _xdg(variable: str, fallback: str) -> Path:
    value = os.environ.get(variable)
    return Path(value) if value else Path.home() / fallback


def cache_dir() -> Path:
    """Downloaded weights and calibration results; MLXSPEC_CACHE overrides."""
    override = os.environ.get("MLXSPEC_CACHE")
    return Path(override) if override else _xdg("XDG_CACHE_HOME", ".cache") / "mlxspec"


def config_dir() -> Path:
    return _xdg("XDG_CONFIG_HOME", ".config") / "mlxspec"


def data_dir() -> Path:
    """Saved conversations; MLXSPEC_DATA overrides."""
    override = os.environ.get("MLXSPEC_DATA")
    return Path(override) if override else _xdg("XDG_DATA_HOME", ".local/share") / "mlxspec"


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on `path` (created if missing) for a read-modify-write of a file
    that two processes share (chat and serve at once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
