"""Load a fast BLAS for MLX's Linux CPU backend before `mlx.core` is imported.

The Linux `mlx[cpu]` wheel links a reference BLAS (fp32 matmul ~2.5 GFLOP/s on a
small x86 box). Loading OpenBLAS into the global symbol namespace first makes MLX
resolve its BLAS calls there (~150 GFLOP/s), which is what makes verifying several
draft tokens nearly as cheap as one. macOS uses Accelerate/Metal and is left alone.

Only a system OpenBLAS is looked for. PyPI's `cmeel-openblas` ships an unprefixed
libopenblas.so, but each release is built for one CPU (DYNAMIC_ARCH=OFF: 0.3.31 and
0.3.23 for SKYLAKEX, 0.3.29 for ZEN) and needs the system's libgfortran.so.5: 0.3.31
dies with SIGILL on an AVX2-only AMD EPYC, which no `try` can catch. numpy's bundled
OpenBLAS has prefixed symbols MLX does not look up.
"""

from __future__ import annotations

import ctypes
import os
import sys

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)

NO_OPENBLAS = "reference (no OpenBLAS found)"
SLOW_BLAS_HINT = (
    "MLX is using the reference BLAS here, so verifying k drafted tokens costs about k "
    "plain steps and speculation mostly stays off; install OpenBLAS "
    "(`sudo apt install libopenblas0-pthread`; Fedora, Arch: the openblas package) "
    "for ~40x faster matmul"
)

# What the process ended up with; read by the run record and `mlxspec models`.
blas_in_use: str = "platform default"
_openblas: ctypes.CDLL | None = None  # the library loaded, for `share_cores`


def slow_blas_hint() -> str | None:
    """The one line to show when no fast BLAS was found (None when one was, or when the
    user turned it off on purpose)."""
    return SLOW_BLAS_HINT if blas_in_use == NO_OPENBLAS else None


def preload_openblas() -> str:
    """Load OpenBLAS with RTLD_GLOBAL on Linux; return a label for the BLAS in use.

    Must run before the first `import mlx.core`; afterwards it cannot change what
    MLX already bound. Set MLXSPEC_NO_OPENBLAS=1 to measure the reference BLAS.
    """
    global blas_in_use, _openblas
    if not sys.platform.startswith("linux"):
        blas_in_use = "Accelerate/Metal" if sys.platform == "darwin" else "platform default"
        return blas_in_use
    if os.environ.get("MLXSPEC_NO_OPENBLAS"):
        blas_in_use = "reference (OpenBLAS disabled by MLXSPEC_NO_OPENBLAS)"
        return blas_in_use
    if "mlx.core" in sys.modules:
        blas_in_use = "reference (mlx.core was imported before mlxspec)"
        return blas_in_use
    for path in OPENBLAS_CANDIDATES:
        if os.path.exists(path):
            try:
                _openblas = ctypes.CDLL(path, mode=os.RTLD_GLOBAL)
            except OSError:
                continue
            blas_in_use = f"OpenBLAS ({path})"
            return blas_in_use
    blas_in_use = NO_OPENBLAS
    return blas_in_use


def share_cores(processes: int) -> int | None:
    """Give OpenBLAS this process's share of the cores where `processes` ranks share one
    machine; return the threads it now uses (None: unchanged).

    Each OpenBLAS starts a thread per core, and its idle threads spin before they sleep:
    three ranks on two cores ran SmolLM2's sharded plain decoding 2.3x slower with two
    threads each than with one (0.35 against 0.81 tok/s, 90 s of system CPU against 36 s).
    A user's own OPENBLAS_NUM_THREADS is kept; so is one process per machine.
    """
    if _openblas is None or processes <= 1 or "OPENBLAS_NUM_THREADS" in os.environ:
        return None
    return set_threads(max(1, cores() // processes))


def cores() -> int:
    """The cores this process may run on."""
    found = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return found or 1


def set_threads(threads: int) -> int | None:
    """Have OpenBLAS use `threads` threads from now on; None where it is not what runs."""
    if _openblas is None:
        return None
    _openblas.openblas_set_num_threads(threads)
    return threads
