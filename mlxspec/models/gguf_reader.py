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
within 4-bit (or 8-bit) affine error of it.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

GROUP_SIZE = 32  # as mx.load keeps llama.cpp's Q4_0/Q4_1/Q8_0 blocks
MLX_READS = {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0"}  # what mx.load parses itself
# Quants of more than 4 bits a weight, kept as 8-bit affine; the rest as 4-bit.
EIGHT_BIT = {"Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "Q8_1", "Q8_K"}


class UnreadableGGUF(ValueError):
    """A tensor type neither MLX nor the gguf package can read; the message names it."""


def read_gguf(path: Path, *, keep_quantized: bool) -> tuple[dict, dict]:
    """(tensors, metadata) as `mx.load(path, return_metadata=True)` gives them: MLX's reader
    where the file holds only what it reads exactly, else the gguf package's (a quantized
    matrix as float32, or, with `keep_quantized`, as `weight`/`scales`/`biases` affine
    triplets)."""
    try:
        from gguf import GGUFReader
    except ImportError:  # without the package, MLX's reader is all there is
        return _mlx_load(path)
    reader = GGUFReader(str(path))
    if {tensor.tensor_type.name for tensor in reader.tensors} <= MLX_READS:
        return _mlx_load(path)
    # MLX's reader fails on some K-quants (Q3_K, Q5_K) and, worse, reads Q4_K without an
    # error but wrong (its weights off by the size of the weights themselves: measured
    # against llama.cpp's dequantization in tests/test_gguf_quants.py).
    return _tensors(reader, keep_quantized), _metadata(reader)


def tensor_types(path: Path) -> dict[str, str]:
    """Each tensor's type (F32, Q4_K...), from the header (MLX's reader, where the gguf
    package is missing, says only its names)."""
    try:
        from gguf import GGUFReader
    except ImportError:
        return {name: "?" for name in _mlx_load(path)[0]}
    return {tensor.name: tensor.tensor_type.name for tensor in GGUFReader(str(path)).tensors}


def _mlx_load(path: Path) -> tuple[dict, dict]:
    try:
        return mx.load(str(path), format="gguf", return_metadata=True)  # an Ollama blob: no suffix
    except (RuntimeError, ValueError) as err:
        raise UnreadableGGUF(
            f"{path.name}: MLX cannot read its tensors ({err}); `pip install gguf` reads "
            "K-quants and the other llama.cpp quants"
        ) from None


def read_gguf_metadata(path: Path) -> dict:
    """The metadata alone (a tokenizer's, say), without reading the tensors where MLX
    cannot."""
    try:
        from gguf import GGUFReader
    except ImportError:
        return _mlx_load(path)[1]
    return _metadata(GGUFReader(str(path)))


def _tensors(reader, keep_quantized: bool) -> dict[str, mx.array]:
    from gguf import quants

    tensors = {}
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind in ("F32", "F16", "BF16"):
            data = np.asarray(tensor.data)
            if kind == "BF16":  # stored as uint16 halves of float32
                data = (data.astype(np.uint32) << 16).view(np.float32)
            tensors[tensor.name] = mx.array(data.astype(np.float32))
            continue
        try:
            weights = quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
        except (NotImplementedError, ValueError) as err:
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


def _metadata(reader) -> dict:
    """The key-value metadata as mx.load gives it: strings and lists of strings as they
    are, numbers as MLX arrays of their stored type."""
    from gguf import GGUFValueType

    metadata = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue  # the header's own counts: mx.load leaves them out
        kind = field.types[0] if field.types else None
        if kind == GGUFValueType.STRING:
            metadata[name] = field.contents()
        elif kind == GGUFValueType.ARRAY:
            item = field.types[1] if len(field.types) > 1 else None
            if item == GGUFValueType.STRING:
                metadata[name] = field.contents()
            else:
                values = [field.parts[index][0] for index in field.data]
                metadata[name] = mx.array(np.array(values))
        elif kind == GGUFValueType.BOOL:
            metadata[name] = bool(field.parts[field.data[0]][0])
        else:
            metadata[name] = mx.array(field.parts[field.data[0]][0])
    return metadata
