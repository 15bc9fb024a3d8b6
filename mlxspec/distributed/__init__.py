"""The target sharded across processes (and machines) with MLX's own distributed engine.

`launch` re-runs the CLI under `mlx.launch` (--ranks N locally, --hostfile for machines);
`rank` is what every launched process does: shard the model, agree on each request, run
the unchanged speculative loop, and check after every round that no rank has diverged.
"""

from mlxspec.distributed.errors import DistributedError

__all__ = ["DistributedError"]
