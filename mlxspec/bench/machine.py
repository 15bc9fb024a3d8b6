"""The machine section of a bench report, and the memory-bandwidth roofline.

Plain decoding reads every weight once per token, so weight bytes / memory bandwidth
is a ceiling on plain tokens/s; how close plain mlx-lm gets says how much headroom a
faster plain loop could have, and speculation is the way past the ceiling.
"""

from __future__ import annotations

import os
import platform
import subprocess
import time
from importlib import metadata
from pathlib import Path

import mlx.core as mx

from mlxspec import device

BANDWIDTH_ARRAY_BYTES = 256 * 2**20  # far beyond any CPU cache
BANDWIDTH_REPEATS = 5


def describe_machine() -> dict:
    facts = device.describe()
    return {
        "os": platform.platform(),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "memory_bytes": memory_bytes(),
        "device": facts["device"],
        "blas": facts["blas"],
        "mlx": facts["mlx"],
        "mlx_lm": metadata.version("mlx-lm"),
    }


def cpu_model() -> str:
    if platform.system() == "Darwin":
        try:
            return subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None


def measure_bandwidth(n_bytes: int | None = None, repeats: int = BANDWIDTH_REPEATS) -> float:
    """Read bandwidth in bytes/s: the best of `repeats` sums over a large float32 array
    (a read-only sweep, like the weights in a decode step) on MLX's default device."""
    n_bytes = n_bytes or BANDWIDTH_ARRAY_BYTES
    data = mx.ones(n_bytes // 4, dtype=mx.float32)
    mx.eval(data)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(data.sum())
        best = min(best, time.perf_counter() - start)
    return data.nbytes / best


def roofline(weights: int, bandwidth: float, plain_speed: float | None) -> dict:
    ceiling = bandwidth / weights
    return {
        "weight_bytes": weights,
        "bandwidth_bytes_per_second": bandwidth,
        "ceiling_tokens_per_second": ceiling,
        "plain_tokens_per_second": plain_speed,
        "plain_percent_of_ceiling": 100 * plain_speed / ceiling if plain_speed else None,
    }
