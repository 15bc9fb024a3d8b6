"""Which MLX device runs the models, and what that implies for weight dtypes."""

from __future__ import annotations

import os
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


def tf32_matmuls() -> bool:
    """Whether float32 matmuls run as TF32 (10-bit mantissa inputs) on this device.

    MLX's CUDA backend does so unless MLX_ENABLE_TF32=0 (its documented default is 1), for
    GEMMs (a verify of several tokens) but not for one-token GEMVs: a verify then rounds
    ~1e-3 relative apart from plain steps, which widens the near tie (sampling.py). MLX
    reads the same variable on Apple's M5-class GPUs; no Mac here to tell them apart, so
    Metal reports False. The CPU never does."""
    return device_name() == "cuda" and os.environ.get("MLX_ENABLE_TF32", "1") != "0"


def describe() -> dict:
    """Machine facts for run records and `mlxspec models --json`."""
    return {
        "device": device_name(),
        "tf32": tf32_matmuls(),
        "blas": blas.blas_in_use,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "mlx": mx.__version__,
    }
