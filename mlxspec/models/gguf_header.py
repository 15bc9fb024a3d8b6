"""A GGUF file's header read straight from its bytes: the metadata and where each tensor lies.

The `gguf` package's GGUFReader makes a numpy view of every metadata item, which took 8.7 s
for Gemma 3's 262,144-token vocabulary here, on each `mlxspec models` and each load. The same
layout (llama.cpp's `docs/gguf.md`; gguf-py's `gguf_reader.py`) read with `struct` takes a
fraction of a second. Little-endian files of version 2 and 3 (all llama.cpp has written since
2023); anything else is one line.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
STRING, ARRAY, BOOL = 8, 9, 7
# GGUF value type -> numpy dtype, for the numbers (gguf-py's GGUFValueType).
NUMBER_TYPES = {
    0: np.uint8,
    1: np.int8,
    2: np.uint16,
    3: np.int16,
    4: np.uint32,
    5: np.int32,
    6: np.float32,
    BOOL: np.bool_,
    10: np.uint64,
    11: np.int64,
    12: np.float64,
}


class BadGGUFHeader(ValueError):
    """Not a GGUF file this reader knows; the message is one line."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # as the file lists them: the fastest-moving first
    type_id: int  # GGMLQuantizationType's value
    start: int  # the byte in the file where its data begins


@dataclass(frozen=True)
class Header:
    # Numbers are numpy scalars (or arrays) of their stored type, so a caller can keep it.
    metadata: dict
    tensors: list[TensorInfo]


def read_header(path: Path) -> Header:
    """The file's metadata and tensor table; BadGGUFHeader where it is not a GGUF it reads."""
    name = Path(path).name
    with open(path, "rb") as file:
        if not os.fstat(file.fileno()).st_size:
            raise BadGGUFHeader(f"{name}: not a GGUF file (it is empty)")
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            try:
                return _Parser(buf).header()
            except BadGGUFHeader as err:
                raise BadGGUFHeader(f"{name}: {err}") from None
            except (struct.error, UnicodeDecodeError, IndexError, ValueError) as err:
                # ValueError: numpy's "buffer is smaller than requested size"
                raise BadGGUFHeader(f"{name}: a torn or invalid GGUF header ({err})") from None


class _Parser:
    def __init__(self, buf):
        self.buf = buf
        self.at = 0

    def _take(self, form: str):
        values = struct.unpack_from(form, self.buf, self.at)
        self.at += struct.calcsize(form)
        return values[0] if len(values) == 1 else values

    def _string(self) -> str:
        length = self._take("<Q")
        text = bytes(self.buf[self.at : self.at + length]).decode("utf-8")
        self.at += length
        return text

    def _value(self, kind: int):
        if kind == STRING:
            return self._string()
        if kind == ARRAY:
            item, count = self._take("<IQ")
            if item == STRING:
                return [self._string() for _ in range(count)]
            if item not in NUMBER_TYPES:
                raise BadGGUFHeader(f"GGUF array of value type {item} is not readable")
            dtype = np.dtype(NUMBER_TYPES[item]).newbyteorder("<")
            values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.at).copy()
            self.at += values.nbytes
            return values
        if kind not in NUMBER_TYPES:
            raise BadGGUFHeader(f"GGUF value type {kind} is not readable")
        dtype = np.dtype(NUMBER_TYPES[kind]).newbyteorder("<")
        value = np.frombuffer(self.buf, dtype=dtype, count=1, offset=self.at)[0]
        self.at += dtype.itemsize
        return bool(value) if kind == BOOL else value

    def header(self) -> Header:
        if bytes(self.buf[:4]) != MAGIC:
            raise BadGGUFHeader("not a GGUF file (its first bytes are not 'GGUF')")
        self.at = 4
        version, n_tensors, n_fields = self._take("<IQQ")
        if version not in (2, 3):
            raise BadGGUFHeader(f"GGUF version {version} is not readable (2 and 3 are)")
        metadata = {}
        for _ in range(n_fields):
            key = self._string()
            metadata[key] = self._value(self._take("<I"))
        table = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._take("<I")
            dims = struct.unpack_from(f"<{n_dims}Q", self.buf, self.at)
            self.at += 8 * n_dims
            type_id, offset = self._take("<IQ")
            table.append((name, dims, type_id, offset))
        alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-self.at // alignment) * alignment
        tensors = [TensorInfo(n, d, t, start + offset) for n, d, t, offset in table]
        return Header(metadata, tensors)
