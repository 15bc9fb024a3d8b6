"""A GGUF file's `<arch>.*` metadata read as Python numbers, and the one error every GGUF
module raises where a file cannot be mapped faithfully: shared by gguf_arch (the config),
gguf_rope (its rope scaling) and gguf_tokenizer."""

from __future__ import annotations

import mlx.core as mx
import numpy as np


class GGUFError(ValueError):
    """A GGUF file this loader cannot map faithfully; the message is one line."""


class Metadata:
    """`<arch>.KEY` numbers of one file as Python numbers; a missing required key: GGUFError."""

    def __init__(self, metadata: dict, architecture: str):
        self.metadata = metadata
        self.architecture = architecture

    def __call__(self, key: str, default=None):
        value = self.metadata.get(f"{self.architecture}.{key}", default)
        if value is None:
            raise GGUFError(f"GGUF metadata lacks {self.architecture}.{key}")
        return python_number(value)

    def has(self, key: str) -> bool:
        return f"{self.architecture}.{key}" in self.metadata


def python_number(value):
    """A metadata value as mx.load gives it (a 0-d array) as a plain Python number."""
    if isinstance(value, mx.array):
        value = np.array(value)
        value = value.item() if value.ndim == 0 else value.tolist()
        if isinstance(value, float):
            # float32 metadata: keep the short decimal it was written as (1e-05, not 9.99e-06).
            return float(str(np.float32(value)))
    return value
