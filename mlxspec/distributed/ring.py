"""The ring backend's ranks, each started as mlx.launch's ring launcher starts it.

The ring needs nothing from a launcher but a few variables per rank: MLX_RANK, and
MLX_HOSTFILE, a file listing every rank's ip:port (read once, by `mx.distributed.init`).
So mlxspec starts ring ranks itself, both for `chat` (rank 0 in the process the user
started, see `followers`) and for every other command (all ranks as children, see
`ranks`): mlx.launch's relay never sleeps while its ranks run (issue 51), and it gives
rank 0 pipes where the chat wants the terminal. What a rank gets, here as from
mlx.launch 0.32 (`_distributed_utils/launch.py`: `launch_ring`, `RemoteProcess`):

- a local rank: this process's environment, the hostfile's `envs`, the terminal's
  COLUMNS/LINES, MLX_RANK and MLX_HOSTFILE;
- a rank on another host, over `ssh -o BatchMode=yes` (keys, no password prompt): this
  directory if it exists there, the same Python path, mlxspec's own `MLXSPEC_*`
  variables, the same `envs` and terminal size, and the ring's addresses in a temporary
  file of its own. (mlx.launch runs `ssh -tt`, whose remote terminal merges a rank's
  stderr into its stdout; without it the exit markers stay on stderr, and a rank whose
  connection drops ends by `exit_with_parent`.)
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import tempfile
from dataclasses import dataclass

from mlxspec.distributed.config import CHILD_ENV, RankConfig
from mlxspec.distributed.launch import (
    LaunchRequest,
    free_port_base,
    read_hostfile_envs,
    read_hostfile_ips,
)
from mlxspec.processes import PARENT_ENV, child_env

HOSTFILE_PORT = 32323  # mlx.launch's --starting-port default, which hosts' firewalls may allow


@dataclass
class Ring:
    """Where every rank listens, and how each one is started."""

    request: LaunchRequest
    addresses: list[list[str]]  # per rank, its ip:port list
    extra_env: dict[str, str]  # the hostfile's `envs` and the terminal's size
    path: str = ""  # the local address file, while it exists

    @classmethod
    def plan(cls, request: LaunchRequest, hostfile_port: int | None = None) -> Ring:
        """Loopback addresses for `--ranks`; a hostfile's `ips`, ports counted up from
        `hostfile_port` (else one free here), as mlx.launch counts from its starting
        port."""
        if not request.hostfile:
            base = free_port_base(request.size)
            addresses = [[f"127.0.0.1:{base + rank}"] for rank in range(request.size)]
            return cls(request, addresses, _terminal_size())
        ips = read_hostfile_ips(request.hostfile)
        port = hostfile_port or free_port_base(sum(map(len, ips)))
        addresses = []
        for host_ips in ips:
            addresses.append([f"{ip}:{port + i}" for i, ip in enumerate(host_ips)])
            port += len(host_ips)
        return cls(request, addresses, read_hostfile_envs(request.hostfile) | _terminal_size())

    def write(self) -> str:
        """The local address file (as mlx.launch writes it: empty for one rank)."""
        handle, self.path = tempfile.mkstemp(prefix="mlxspec-ring-", suffix=".json")
        with os.fdopen(handle, "w") as file:
            file.write(json.dumps(self.addresses) if len(self.addresses) > 1 else "")
        return self.path

    def forget(self) -> None:
        """Remove the address file: once every rank has joined, nothing reads it again."""
        if self.path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            self.path = ""

    def env(self, rank: int) -> dict[str, str]:
        """A rank's environment here (for ssh: what the remote line exports from it).
        The child ends if this process is killed (`child_env`)."""
        config = RankConfig(self.request.backend, self.request.parallel, self.request.timeout)
        env = {**child_env(), **self.extra_env, CHILD_ENV: config.to_env()}
        return env | {"MLX_RANK": str(rank), "MLX_HOSTFILE": self.path}

    def argv(self, rank: int, command: list[str]) -> list[str]:
        """What to run for `rank`: the command itself, or ssh to the rank's host."""
        if not self.request.hostfile:
            return command
        exports = {k: v for k, v in self.env(rank).items() if k.startswith("MLXSPEC_")}
        exports.pop(PARENT_ENV, None)  # its parent there is ssh's
        exports |= self.extra_env
        remote = remote_script(rank, json.dumps(self.addresses), command, exports)
        return ["ssh", "-o", "BatchMode=yes", self.request.hosts[rank], remote]


def remote_script(rank: int, ring: str, command: list[str], exports: dict[str, str]) -> str:
    """The shell line another host runs for `rank`, as mlx.launch's ring launcher writes
    it: this directory if it exists there, the variables, the ring's addresses in a file
    of its own, then the rank itself."""
    script = f"cd {shlex.quote(os.getcwd())} 2>/dev/null; "
    for key, value in sorted(exports.items()):
        script += f"export {key}={shlex.quote(value)}; "
    script += f"ring=$(mktemp); printf %s {shlex.quote(ring)} > $ring; "
    script += f"export MLX_HOSTFILE=$ring MLX_RANK={rank}; "
    return script + "exec " + " ".join(map(shlex.quote, command))


def ranks_on_my_host(addresses: list[list[str]], rank: int) -> int:
    """How many of the ring's ranks listen on `rank`'s first address's host (itself
    included): all of them for `--ranks`' loopback ring, those a hostfile puts on the
    same machine's ips otherwise."""
    host = addresses[rank][0].rsplit(":", 1)[0]
    return sum(1 for ips in addresses if ips and ips[0].rsplit(":", 1)[0] == host)


def _terminal_size() -> dict[str, str]:
    """COLUMNS and LINES as mlx.launch passes them, where there is a terminal to read."""
    columns, lines = shutil.get_terminal_size((0, 0))
    return {"COLUMNS": str(columns), "LINES": str(lines)} if columns > 0 else {}
