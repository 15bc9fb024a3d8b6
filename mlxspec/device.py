"""Which MLX device runs the models, and what that implies for weight dtypes."""

from __future__ import annotations

import platform

import mlx.core as mx

from mlxspec import blas


def device_name() -> str:
    """'metal', 'cuda' or 'cpu': the backend of MLX's default device."""
    if mx.default_device() == mx.cpu:
        return "cpu"
    if getattr(mx, "cuda", None) is not None and mx.cuda.is_available():
        return "cuda"
    return "metal"


def prefers_dequantized_weights() -> bool:
    """True where quantized matmul is slow (MLX's CPU backend): load weights as fp32.

    On Metal and CUDA quantized kernels are fast and save bandwidth, so keep them.
    """
    return device_name() == "cpu"


def describe() -> dict:
    """Machine facts for run records and `mlxspec models --json`."""
    return {
        "device": device_name(),
        "blas": blas.blas_in_use,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "mlx": mx.__version__,
    }
