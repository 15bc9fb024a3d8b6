"""Prompt caches on disk: a restarted `serve`, or `chat` and `generate` on the same
system prompt, start from what an earlier process prefilled.

The memory pool (`prompt_cache.PromptCache`) is the hot tier; this is its spill and its
memory across processes. Entries reach the disk when the pool lets them go and when
the process ends (`PromptCache.flush`), not after every request: a 20k-token
conversation of an 8B model is about 3 GB of KV, and writing it each turn would cost
an agent more than it saves.

Each entry is one safetensors file written by mlx-lm's `save_prompt_cache` (each
layer's `state`, its class, scalars), its tokens, layers' form and model key in the
file's metadata. At start only the headers are read (the JSON before the tensors),
so finding the longest prefix a prompt shares loads nothing. Files live under one
folder per model and weight form (`key`): a cache computed from other weights can
never be handed to this model. Writes go to a temporary file renamed into place, so a
crash leaves no half-file; a file that cannot be read is skipped with a warning and
removed. The folder is bounded in bytes, least recently used out first (a read
touches the file).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from mlxspec.models.kv_form import start_of
from mlxspec.models.prompt_cache import (
    MIN_REUSE,
    Kept,
    cache_bytes,
    form_of,
    prefix_copy,
    reusable_length,
    supersedes,
)

log = logging.getLogger("mlxspec.prompt_cache")

MIN_DISK_TOKENS = 256  # a shorter prompt is prefilled faster than its file is read
SUFFIX = ".safetensors"


@dataclass
class OnDisk:
    path: Path
    tokens: list[int]
    form: tuple[str, ...]
    cuttable: bool
    nbytes: int

    def reusable(self, tokens: list[int]) -> int:
        n = reusable_length(self.tokens, self.cuttable, tokens, MIN_REUSE)
        start = start_of(self.form)  # held quantized past it: not cut below it (`Kept`)
        return 0 if n < start < len(self.tokens) else n

    @property
    def key(self) -> tuple:
        return self.tokens, self.form, self.cuttable


def folder_name(key: str) -> str:
    """A readable, safe folder for a model and weight form, unique by its hash."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", key).strip("-")[:60]
    return f"{slug}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"


def entry_name(tokens: list[int], form: tuple[str, ...]) -> str:
    digest = hashlib.sha256(json.dumps([tokens, form]).encode()).hexdigest()[:32]
    return digest + SUFFIX


def read_header(path: Path) -> dict:
    """The safetensors file's metadata, without its tensors."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        if size > 1 << 28:
            raise ValueError("header too large")
        return json.loads(f.read(size)).get("__metadata__", {})


class DiskCache:
    """One model's prompt caches in `root/<key's folder>`, at most `max_bytes` of files."""

    def __init__(self, root: Path, key: str, max_bytes: int):
        self.key, self.max_bytes = key, max_bytes
        self.folder = Path(root) / folder_name(key)
        self.entries: dict[str, OnDisk] = {}
        self._warned = False
        self._scan()

    def _scan(self) -> None:
        if not self.folder.is_dir():
            return
        for path in sorted(self.folder.glob("*" + SUFFIX)):
            if path.name.startswith("."):  # a write cut short by a crash
                path.unlink(missing_ok=True)
                continue
            try:
                meta = read_header(path)
                if meta.get("0.key") != self.key:
                    raise ValueError("written for another model or weight form")
                entry = OnDisk(
                    path,
                    json.loads(meta["0.tokens"]),
                    tuple(json.loads(meta["0.form"])),
                    meta["0.cuttable"] == "1",
                    path.stat().st_size,
                )
            except (OSError, ValueError, KeyError, struct.error) as err:
                log.warning("prompt cache: skipping %s (%s)", path.name, err)
                continue
            self.entries[path.name] = entry

    @property
    def nbytes(self) -> int:
        return sum(entry.nbytes for entry in self.entries.values())

    def has(self, tokens: list[int], form: tuple[str, ...]) -> bool:
        return entry_name(tokens, form) in self.entries

    def write(self, kept: Kept) -> None:
        """Keep `kept` on disk (a no-op for short or already written entries). A full or
        read-only disk costs a warning, once; the request goes on without the file."""
        if len(kept.tokens) < MIN_DISK_TOKENS or self.max_bytes <= 0:
            return
        name = entry_name(kept.tokens, kept.form)
        if name in self.entries:
            return
        path = self.folder / name
        # mx.save_safetensors adds the suffix to a name without it: give it one
        temporary = path.with_name(f".{name}.{os.getpid()}.partial{SUFFIX}")
        metadata = {
            "key": self.key,
            "tokens": json.dumps(kept.tokens),
            "form": json.dumps(list(kept.form)),
            "cuttable": "1" if kept.cuttable else "0",
        }
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            # mx.save_safetensors adds the suffix to a name without it
            save_prompt_cache(
                str(temporary) + SUFFIX, prefix_copy(kept, len(kept.tokens)), metadata
            )
            os.replace(str(temporary) + SUFFIX, path)
        except OSError as err:
            self._warn(f"cannot write {path} ({err.strerror or err}); going on without it")
            temporary.unlink(missing_ok=True)
            return
        self.entries[name] = OnDisk(
            path, list(kept.tokens), kept.form, kept.cuttable, path.stat().st_size
        )
        new = self.entries[name]
        for other in [
            e for e in self.entries.values() if e is not new and supersedes(new.key, e.key)
        ]:
            self._remove(other)
        self._bound()

    def read(self, tokens: list[int], form: tuple[str, ...]) -> Kept | None:
        """The entry of `form` sharing the longest reusable prefix with `tokens`, loaded
        (None: none, or its file could not be read)."""
        best, length = None, 0
        for entry in self.entries.values():
            if entry.form == form and (n := entry.reusable(tokens)) > length:
                best, length = entry, n
        if best is None:
            return None
        try:
            cache, meta = load_prompt_cache(str(best.path), return_metadata=True)
            if meta.get("key") != self.key or json.loads(meta["tokens"]) != best.tokens:
                raise ValueError("its metadata does not match its name")
            kept = Kept(best.tokens, cache, cache_bytes(cache), form)
            if form_of(cache) != form[: len(cache)] or len(form) > len(cache) + 1:
                raise ValueError("its layers are not the model's")
            os.utime(best.path)  # recently used: the last to go
        except Exception as err:  # a torn or foreign file must not fail the request
            log.warning("prompt cache: skipping %s (%s)", best.path.name, err)
            self._remove(best)
            return None
        return kept

    def clear(self) -> int:
        """Remove every file; returns the bytes freed."""
        freed = self.nbytes
        for entry in list(self.entries.values()):
            self._remove(entry)
        return freed

    def _remove(self, entry: OnDisk) -> None:
        self.entries.pop(entry.path.name, None)
        try:
            entry.path.unlink(missing_ok=True)
        except OSError as err:
            self._warn(f"cannot remove {entry.path} ({err.strerror or err})")

    def _bound(self) -> None:
        def used(entry: OnDisk) -> float:
            try:
                return entry.path.stat().st_mtime
            except OSError:
                return 0.0

        for entry in sorted(self.entries.values(), key=used):
            if self.nbytes <= self.max_bytes:
                break
            self._remove(entry)

    def _warn(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("prompt cache: %s", message)
