"""What the launching process tells every rank (light: imported by the CLI at start)."""

from __future__ import annotations

import os
from dataclasses import dataclass

CHILD_ENV = "MLXSPEC_DISTRIBUTED"  # "backend:parallel:timeout", set through mlx.launch --env
FAULT_ENV = "MLXSPEC_FAULT"  # tests only: "trim|die|hang|weights:RANK:ROUND", comma-separated
BACKENDS = ("ring", "jaccl", "mpi")
PARALLEL_MODES = ("tensor", "pipeline")


@dataclass(frozen=True)
class RankConfig:
    backend: str
    parallel: str
    timeout: float

    def to_env(self) -> str:
        return f"{self.backend}:{self.parallel}:{self.timeout:g}"

    @classmethod
    def from_env(cls) -> RankConfig | None:
        value = os.environ.get(CHILD_ENV)
        if not value:
            return None
        backend, parallel, timeout = value.split(":")
        return cls(backend, parallel, float(timeout))
