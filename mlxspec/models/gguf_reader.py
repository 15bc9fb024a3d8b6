"""A GGUF file's tensors and metadata in the shape `mx.load` gives them, for every quant the
file may hold.

MLX's own reader maps float tensors and Q4_0, Q4_1 and Q8_0 blocks exactly; most published
GGUFs are K-quants (Q4_K_M, Q5_K_M, Q6_K...), on which it fails ("gguf_tensor_to_f16
failed", Q3_K and Q5_K) or, for Q4_K, gives wrong weights without an error. Those files are
read with llama.cpp's own reader, the `gguf` package (its `quants.dequantize` covers the
K-quants, Q5_0/Q5_1 and the IQ types), each matrix dequantized, then either kept as float32
or quantized again in MLX's own affine form (`mx.quantize`, groups of 32, 8 bits where the
file held more than 4, else 4), so that a Mac holds about what the file held. Requantizing
adds MLX's rounding to llama.cpp's: the float path is exact to the file, the quantized one
within 4-bit (or 8-bit) affine error of it. The header is read by `gguf_header`, the
blocks where the file holds them (a memory map), so nothing is read twice.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from mlxspec.models.gguf_header import BadGGUFHeader, Header, TensorInfo, read_header

GROUP_SIZE = 32  # as mx.load keeps llama.cpp's Q4_0/Q4_1/Q8_0 blocks
MLX_READS = {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0"}  # what mx.load parses itself
# Quants of more than 4 bits a weight, kept as 8-bit affine; the rest as 4-bit.
EIGHT_BIT = {"Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "Q8_1", "Q8_K"}


class UnreadableGGUF(ValueError):
    """A tensor type neither MLX nor the gguf package can read; the message names it."""


def read_gguf(path: Path, *, keep_quantized: bool) -> tuple[dict, dict]:
    """(tensors, metadata) as `mx.load(path, return_metadata=True)` gives them: MLX's reader
    where the file holds only what it reads exactly, else llama.cpp's dequantization (a
    quantized matrix as float32, or, with `keep_quantized`, as `weight`/`scales`/`biases`
    affine triplets)."""
    header = _header(path)
    if {_type_name(tensor) for tensor in header.tensors} <= MLX_READS:
        return _mlx_load(path)
    # MLX's reader fails on some K-quants (Q3_K, Q5_K) and, worse, reads Q4_K without an
    # error but wrong (its weights off by the size of the weights themselves: measured
    # against llama.cpp's dequantization in tests/test_gguf_quants.py).
    return _tensors(path, header, keep_quantized), _metadata(header)


def tensor_types(path: Path) -> dict[str, str]:
    """Each tensor's type (F32, Q4_K...), from the header."""
    return {tensor.name: _type_name(tensor) for tensor in _header(path).tensors}


def read_gguf_metadata(path: Path) -> dict:
    """The metadata alone (a tokenizer's, say), from the header."""
    return _metadata(_header(path))


def read_gguf_header(path: Path) -> tuple[dict, dict[str, str]]:
    """(metadata, each tensor's type) from one read of the header."""
    header = _header(path)
    return _metadata(header), {tensor.name: _type_name(tensor) for tensor in header.tensors}


def _header(path: Path) -> Header:
    try:
        return read_header(path)
    except BadGGUFHeader as err:
        raise UnreadableGGUF(str(err)) from None


def _type_name(tensor: TensorInfo) -> str:
    try:
        return GGMLQuantizationType(tensor.type_id).name
    except ValueError:
        return f"type {tensor.type_id}"


def _mlx_load(path: Path) -> tuple[dict, dict]:
    try:
        return mx.load(str(path), format="gguf", return_metadata=True)  # an Ollama blob: no suffix
    except (RuntimeError, ValueError) as err:
        raise UnreadableGGUF(f"{path.name}: MLX cannot read its tensors ({err})") from None


FLOAT_TYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


def _tensor_data(file: np.ndarray, tensor: TensorInfo, kind: str) -> np.ndarray:
    """The tensor's bytes where the file holds them: floats in numpy's order (slowest
    dimension first), quantized blocks as rows of bytes, as gguf's dequantize takes them."""
    shape = tuple(reversed(tensor.dims))
    count = int(np.prod(tensor.dims))
    if kind in FLOAT_TYPES:
        dtype = np.dtype(FLOAT_TYPES[kind])
        raw = file[tensor.start : tensor.start + count * dtype.itemsize]
        return raw.view(dtype).reshape(shape)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(tensor.type_id)]
    raw = file[tensor.start : tensor.start + count // block * size]
    return raw.reshape(*shape[:-1], shape[-1] // block * size)


def _tensors(path: Path, header: Header, keep_quantized: bool) -> dict[str, mx.array]:
    file = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = {}
    for tensor in header.tensors:
        kind = _type_name(tensor)
        if kind in FLOAT_TYPES:
            data = np.asarray(_tensor_data(file, tensor, kind))
            if kind == "BF16":  # stored as uint16 halves of float32
                data = (data.astype(np.uint32) << 16).view(np.float32)
            tensors[tensor.name] = mx.array(data.astype(np.float32))
            continue
        try:
            weights = quants.dequantize(
                np.asarray(_tensor_data(file, tensor, kind)),
                GGMLQuantizationType(tensor.type_id),
            )
        except (NotImplementedError, ValueError, KeyError) as err:
            raise UnreadableGGUF(
                f"tensor {tensor.name!r} is {kind}, which the gguf package cannot dequantize "
                f"({err}); readable: the float types, Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, the K-quants "
                "(Q2_K to Q6_K) and the IQ types"
            ) from None
        weights = mx.array(weights.astype(np.float32))
        name = tensor.name.removesuffix(".weight")
        if keep_quantized and weights.ndim == 2 and weights.shape[-1] % GROUP_SIZE == 0:
            bits = 8 if kind in EIGHT_BIT else 4
            packed, scales, biases = mx.quantize(weights, group_size=GROUP_SIZE, bits=bits)
            tensors.update(
                {f"{name}.weight": packed, f"{name}.scales": scales, f"{name}.biases": biases}
            )
        else:
            tensors[tensor.name] = weights
    return tensors


def _metadata(header: Header) -> dict:
    """The key-value metadata as mx.load gives it: strings and lists of strings as they
    are, booleans as bools, numbers as MLX arrays of their stored type."""
    metadata = {}
    for name, value in header.metadata.items():
        if isinstance(value, (str, list, bool)):
            metadata[name] = value
        else:
            metadata[name] = mx.array(value)
    return metadata
