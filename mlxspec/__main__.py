"""`python -m mlxspec ...`: the same as the `mlxspec` command (mlx.launch starts ranks so)."""

from mlxspec.cli import main

main()
