"""TF32 on the CPU: what MLX's CUDA backend does to a verify, emulated to test against.

On CUDA (MLX_ENABLE_TF32 unset or 1), float32 GEMMs round their inputs to TF32 (10
mantissa bits, round to nearest) and accumulate in float32, while a one-token step runs
GEMVs in full float32. `emulate_tf32` rounds the inputs of every multi-token Linear and
attention call the same way and tells the engine TF32 is on, so the CPU shows the
divergences an H100 showed (tests/test_lossless.py failed there 3 of 15 times).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlxspec import device, sampling


def to_tf32(x: mx.array) -> mx.array:
    """Float32 rounded to TF32's 10-bit mantissa (nearest, ties away from zero)."""
    if x.dtype != mx.float32:
        return x
    bits = x.view(mx.uint32) + mx.array(0x1000, mx.uint32)
    return (bits & mx.array(0xFFFFE000, mx.uint32)).view(mx.float32)


def emulate_tf32(monkeypatch) -> None:
    """From now on in this test: multi-token float32 matmuls round like TF32 GEMMs, and
    `device.tf32_matmuls()` is True."""
    linear, attention = nn.Linear.__call__, mx.fast.scaled_dot_product_attention

    def tf32_linear(self, x):
        if x.ndim < 2 or x.shape[-2] == 1:  # a GEMV: full float32
            return linear(self, x)
        y = to_tf32(x) @ to_tf32(self["weight"]).T
        return y + self["bias"] if "bias" in self else y

    def tf32_attention(q, k, v, *, scale, mask=None, **options):
        if q.shape[2] > 1:
            q, k, v = to_tf32(q), to_tf32(k), to_tf32(v)
        return attention(q, k, v, scale=scale, mask=mask, **options)

    monkeypatch.setattr(nn.Linear, "__call__", tf32_linear)
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", tf32_attention)
    monkeypatch.setattr(device, "tf32_matmuls", lambda: True)
    monkeypatch.setattr(sampling, "tf32_matmuls", lambda: True)
