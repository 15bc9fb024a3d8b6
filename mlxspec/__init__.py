"""mlxspec: lossless speculative decoding on MLX."""

from mlxspec.blas import preload_openblas

# Before anything imports mlx.core: see blas.py for why the order matters.
preload_openblas()

__version__ = "0.1.0"
