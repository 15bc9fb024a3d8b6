"""The persistent history of one model: earlier prompts and outputs, as a prefix index.

On disk, in `<data dir>/suffix/<model>/`:
- `index.bin`: header, the token stream and its order (int32 each), with CRCs. Written
  only whole, to a temporary file then `os.replace`d, so a kill mid-write leaves the
  old file.
- `journal.bin`: finished requests appended as checksummed records. Appending is
  cheap (no load), so every run can feed the history; the next load merges the
  journal into the index and empties it.
- `lock`: an fcntl lock held around every read-modify-write, so chat and serve can
  share one store.
A damaged file is dropped with ONE warning and the history starts over: a history
only ever proposes drafts, which the target verifies, so losing it costs speed only. A
folder that cannot be written (read-only, the disk full) warns once too, and leaves
every file as it was: a cut append is truncated away, a cut rewrite's temporary removed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import struct
import warnings
import zlib
from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path

import numpy as np

from mlxspec.paths import data_dir, file_lock
from mlxspec.suffix.index import PrefixIndex

DEFAULT_BOUND = 64 * 2**20  # bytes of index.bin: ~8M tokens (two int32 each)
# A journal this long is merged into the index at the next add: merging inserts each
# token with a binary search (~50 us), so ~64k tokens cost a few seconds, now and then.
JOURNAL_BYTES = 256 * 2**10
MAGIC = b"MLXSFX01"
HEADER = struct.Struct("<8sQQII")  # magic, stream length, order length, their CRC32s
RECORD = struct.Struct("<4sII")  # magic, token count, CRC32 of the tokens
RECORD_MAGIC = b"SFXJ"


class HistoryWarning(UserWarning):
    """A damaged history file was dropped, or the history's folder cannot be used (speed
    only is lost, never correctness)."""


def store_dir(model: str) -> Path:
    return data_dir() / "suffix" / re.sub(r"[^A-Za-z0-9._-]", "_", model)


class HistoryStore:
    """One model's history: `add` appends a finished request, `index` loads (once) the
    prefix index with everything appended so far by any process."""

    def __init__(self, directory: Path, bound_bytes: int = DEFAULT_BOUND):
        self.directory, self.bound_bytes = Path(directory), bound_bytes
        self._index: PrefixIndex | None = None
        self._unusable_said = False

    @property
    def loaded(self) -> bool:
        return self._index is not None

    @property
    def index(self) -> PrefixIndex:
        if self._index is None:
            try:
                self._index = self._load()
            except OSError as err:
                self._unusable(err)
                self._index = PrefixIndex()  # this process's requests, in memory only
        return self._index

    def add(self, tokens: Sequence[int]) -> None:
        """Remember one finished request (prompt + output)."""
        if not tokens:
            return
        payload = np.asarray(tokens, np.int32).tobytes()
        record = RECORD.pack(RECORD_MAGIC, len(tokens), zlib.crc32(payload)) + payload
        try:
            with self._locked():
                journal_bytes = _append(self._path("journal.bin"), record)
        except OSError as err:  # a full disk, a read-only folder: the journal is as it was
            self._unusable(err)
            journal_bytes = 0
        if journal_bytes > JOURNAL_BYTES:  # fold the journal in (with other processes' part)
            try:
                self._load()
                return
            except OSError as err:  # the lock could not be taken: keep it in memory
                self._unusable(err)
        if self._index is not None:
            self._index.add_document(list(tokens))
            self._index.drop_oldest(self.bound_bytes // 8)

    def clear(self) -> None:
        with self._locked():
            for name in ("index.bin", "journal.bin", "stats.json"):
                self._path(name).unlink(missing_ok=True)
        self._index = None

    def size_bytes(self) -> int:
        return sum(
            self._path(name).stat().st_size
            for name in ("index.bin", "journal.bin")
            if self._path(name).exists()
        )

    def count(self, drafted: int, accepted: int) -> None:
        """Add a request's drafts from history, and how many were kept, to the totals
        `mlxspec history` shows."""
        if not drafted:
            return
        try:
            with self._locked():
                stats = self.stats()
                stats["drafted"] += drafted
                stats["accepted"] += accepted
                _atomic_write(self._path("stats.json"), json.dumps(stats).encode())
        except OSError as err:
            self._unusable(err)

    def _unusable(self, err: OSError) -> None:
        """The folder cannot be read or written (read-only home, a file in the way): say
        so once; requests go on, the history kept in memory only."""
        if not self._unusable_said:
            self._unusable_said = True
            warnings.warn(
                f"the suffix history cannot be kept in {self.directory} "
                f"({err.strerror or err}); requests go on without it (only speed is lost)",
                HistoryWarning,
                stacklevel=3,
            )

    def stats(self) -> dict[str, int]:
        try:
            data = json.loads(self._path("stats.json").read_text())
            return {"drafted": int(data["drafted"]), "accepted": int(data["accepted"])}
        except (OSError, ValueError, KeyError, TypeError):
            return {"drafted": 0, "accepted": 0}

    def _path(self, name: str) -> Path:
        return self.directory / name

    def _locked(self) -> AbstractContextManager[None]:
        return file_lock(self._path("lock"))

    def _load(self) -> PrefixIndex:
        """The saved index with the journal merged in; when the journal had anything, the
        merged index is written back and the journal emptied (under the lock)."""
        with self._locked():
            index, damaged = _read_index(self._path("index.bin"))
            documents, journal_damaged = _read_journal(self._path("journal.bin"))
            if damaged or journal_damaged:
                warnings.warn(
                    f"the suffix history in {self.directory} was damaged; "
                    "it starts over (only speed is lost)",
                    HistoryWarning,
                    stacklevel=3,
                )
                index = PrefixIndex() if damaged else index
            for document in documents:
                index.add_document(document)
            index.drop_oldest(self.bound_bytes // 8)
            if documents or damaged or journal_damaged:
                try:
                    _atomic_write(self._path("index.bin"), _encode(index))
                    self._path("journal.bin").unlink(missing_ok=True)
                except OSError as err:  # the disk is full: both files stay as they were,
                    self._unusable(err)  # and the merged index serves from memory
        self._index = index
        return index


def _encode(index: PrefixIndex) -> bytes:
    tokens, order = index.tokens.astype("<i4").tobytes(), index.order.astype("<i4").tobytes()
    header = HEADER.pack(
        MAGIC, len(index.tokens), len(index.order), zlib.crc32(tokens), zlib.crc32(order)
    )
    return header + tokens + order


def _read_index(path: Path) -> tuple[PrefixIndex, bool]:
    """(index, damaged): an empty index for a missing file, and for a damaged one."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return PrefixIndex(), False
    if len(data) < HEADER.size:
        return PrefixIndex(), True
    magic, n_tokens, n_order, tokens_crc, order_crc = HEADER.unpack_from(data)
    body = memoryview(data)[HEADER.size :]
    if magic != MAGIC or len(body) != 4 * (n_tokens + n_order) or n_tokens < 1:
        return PrefixIndex(), True
    tokens_bytes, order_bytes = body[: 4 * n_tokens], body[4 * n_tokens :]
    if zlib.crc32(tokens_bytes) != tokens_crc or zlib.crc32(order_bytes) != order_crc:
        return PrefixIndex(), True
    tokens = np.frombuffer(tokens_bytes, "<i4")
    order = np.frombuffer(order_bytes, "<i4")
    return PrefixIndex(tokens, order), False


def _read_journal(path: Path) -> tuple[list[list[int]], bool]:
    """(documents, damaged): the records up to the first unreadable one (a write cut
    short by a kill, or garbage)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return [], False
    documents, offset = [], 0
    while offset < len(data):
        if len(data) - offset < RECORD.size:
            return documents, True
        magic, count, crc = RECORD.unpack_from(data, offset)
        payload = data[offset + RECORD.size : offset + RECORD.size + 4 * count]
        if magic != RECORD_MAGIC or len(payload) != 4 * count or zlib.crc32(payload) != crc:
            return documents, True
        documents.append(np.frombuffer(payload, "<i4").tolist())
        offset += RECORD.size + 4 * count
    return documents, False


def _append(path: Path, record: bytes) -> int:
    """Append one record whole (the file's new size), or leave the file as it was: a
    write the disk cuts short (ENOSPC) is truncated away, so no half record is left for
    the next load to call damage."""
    with open(path, "ab") as journal:
        before = journal.tell()
        try:
            journal.write(record)
            journal.flush()
            os.fsync(journal.fileno())
        except OSError:
            with contextlib.suppress(OSError):
                journal.truncate(before)
            raise
        return journal.tell()


def _atomic_write(path: Path, data: bytes) -> None:
    """`path` replaced whole, or not at all: a temporary file renamed over it; one the disk
    cut short is removed rather than left to fill it further."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


_OPEN: dict[str, HistoryStore] = {}


def history_store(model: str) -> HistoryStore:
    """The one store object per model and data dir in this process (nothing is read
    until used)."""
    directory = store_dir(model)
    if str(directory) not in _OPEN:
        _OPEN[str(directory)] = HistoryStore(directory)
    return _OPEN[str(directory)]
