"""Re-run this very command under `mlx.launch`, one process per rank, and turn what the
ranks report into one exit code and, on failure, one `Error: ...` line.

`mlx.launch` starts the ranks (locally, or over ssh from a hostfile), relays their
output, and stops the others when one fails, but always exits 0 itself; so every rank
prints a marker line with its exit code on stderr, and this process reads them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from mlxspec.distributed.config import CHILD_ENV, FAULT_ENV, RankConfig
from mlxspec.distributed.errors import DistributedError

MARKER = re.compile(r"\x1emlxspec-rank-exit (-?\d+) (-?\d+)")
NODE_EXIT = re.compile(r"Node with rank (\d+) (?:exited with code (-?\d+)|was (killed))")
# MLX's own per-socket chatter when a peer goes away; the summary line says it better.
NOISE = re.compile(r"^(\x1b\[\d+m)?\s*(\[ring\]|\[jaccl\]|\[mpi\]|\[WARN\]|\[INFO\]|\x1b\[0m)")
LOST = "lost the connection to another rank"
LAUNCH = "from mlx._distributed_utils.launch import main; main()"


@dataclass
class LaunchRequest:
    ranks: int | None
    hostfile: str | None
    backend: str
    parallel: str
    timeout: float
    hosts: list[str] = field(default_factory=list)  # ssh names, from the hostfile

    @property
    def size(self) -> int:
        return len(self.hosts) if self.hostfile else int(self.ranks or 1)


def read_hostfile(path: str) -> list[str]:
    """The ssh names of a hostfile in mlx.launch's format, or one clear error."""
    return [str(host["ssh"]) for host in _hostfile_hosts(path)]


def read_hostfile_ips(path: str) -> list[list[str]]:
    """Every host's `ips` in a hostfile (the ring backend needs them), or one clear error."""
    ips = [[str(ip) for ip in host.get("ips", [])] for host in _hostfile_hosts(path)]
    if not all(ips):
        raise DistributedError("the ring backend needs the `ips` of every host in the hostfile")
    return ips


def _hostfile_hosts(path: str) -> list[dict]:
    """The host entries of a hostfile in mlx.launch's format, each with its ssh name."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise DistributedError(f"no hostfile at {file}")
    try:
        data = json.loads(file.read_text())
        hosts = data["hosts"] if isinstance(data, dict) else data
        for host in hosts:
            host["ssh"]  # noqa: B018  (every host names its ssh host: KeyError or TypeError)
    except (ValueError, KeyError, TypeError) as err:
        raise DistributedError(
            f"hostfile {file} is not mlx.launch's format "
            '({"hosts": [{"ssh": "mac1", "ips": ["10.0.0.1"]}, ...]}): ' + str(err)
        ) from None
    if not hosts:
        raise DistributedError(f"hostfile {file} lists no hosts")
    return hosts


def free_port_base(count: int) -> int:
    """A port with `count` free ports after it (the ring backend listens on base + rank)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + count < 65535 and all(_is_free(base + i) for i in range(count)):
            return base
    raise DistributedError("no free local ports for the ring backend")


def _is_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def launch_command(request: LaunchRequest, rank_argv: list[str]) -> list[str]:
    """The mlx.launch command line that runs `python -m mlxspec RANK_ARGV` on every rank."""
    config = RankConfig(request.backend, request.parallel, request.timeout)
    command = [sys.executable, "-c", LAUNCH, "--backend", request.backend]
    if request.hostfile:
        command += ["--hostfile", str(Path(request.hostfile).expanduser())]
    else:
        command += ["--hosts", "127.0.0.1", "-n", str(request.size)]
        if request.backend == "ring":
            command += ["--starting-port", str(free_port_base(request.size))]
    command += ["--env", f"{CHILD_ENV}={config.to_env()}"]
    if os.environ.get(FAULT_ENV):
        command += ["--env", f"{FAULT_ENV}={os.environ[FAULT_ENV]}"]
    return [*command, "--", sys.executable, "-m", "mlxspec", *rank_argv]


def strip_launch_options(argv: list[str]) -> list[str]:
    """The command line for the ranks: ours minus the options that launched them."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in ("--ranks", "--hostfile", "--backend"):
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


@dataclass
class Outcome:
    """What the ranks said on stderr: exit markers, Error lines, the launcher's notes."""

    size: int
    codes: dict[int, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    node_exits: list[tuple[int, str]] = field(default_factory=list)  # launcher's, in order

    def read(self, line: str) -> bool:
        """Take in one stderr line; True when it is for the user to see as it comes."""
        if marker := MARKER.search(line):
            self.codes[int(marker.group(1))] = int(marker.group(2))
            return False
        if node := NODE_EXIT.search(line):
            self.node_exits.append((int(node.group(1)), node.group(2) or "killed"))
            return False
        if line.startswith("Error: "):
            self.errors.append(line.strip()[len("Error: ") :])
            return False
        return not NOISE.match(line)

    def exit_code(self) -> int:
        ok = len(self.codes) == self.size and not any(self.codes.values())
        return 0 if ok else 1

    def message(self, hosts: list[str]) -> str:
        """The one line that says why the run failed: a rank's own words first, then the
        rank whose death cut the others off (not their "connection lost" echo of it)."""
        lost = [e for e in self.errors if LOST in e]
        said = [e for e in self.errors if LOST not in e]
        front = [e for e in said if not e.startswith("rank ")]
        if said:
            return (front or said)[0]
        for rank, code in self.node_exits:
            if code in ("-15", "1") and lost:
                continue  # stopped by mlx.launch, or gave up after another rank failed
            where = f" on {hosts[rank]}" if rank < len(hosts) else ""
            if code == "255" and hosts:
                return f"could not reach rank {rank}'s host{where} over ssh; every rank stopped"
            how = "was killed" if code in ("killed", "-9") else f"exited with code {code}"
            if code.startswith("-") and code != "-9":
                how = f"died from signal {code[1:]}"
            return f"rank {rank}{where} {how} before the answer was complete; every rank stopped"
        if lost:
            return lost[0]
        missing = sorted(set(range(self.size)) - set(self.codes))
        return f"rank(s) {', '.join(map(str, missing))} ended without reporting; every rank stopped"


def run_launched(request: LaunchRequest, rank_argv: list[str], stdin=None) -> int:
    """Run the ranks under mlx.launch, relay their output, return this command's exit code."""
    command = launch_command(request, rank_argv)
    if os.environ.get("MLXSPEC_VERBOSE"):
        sys.stderr.write(f"mlxspec: {' '.join(command)}\n")
    process = subprocess.Popen(
        command,
        stdin=stdin if stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # so that an interrupt can stop every local rank at once
    )
    outcome = Outcome(request.size)
    relay = threading.Thread(target=_relay_stdout, args=(process.stdout,), daemon=True)
    relay.start()
    try:
        for raw in process.stderr:
            line = raw.decode(errors="replace")
            if outcome.read(line) or os.environ.get("MLXSPEC_VERBOSE"):
                sys.stderr.write(line)
                sys.stderr.flush()
        process.wait()
    except KeyboardInterrupt:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait()
        raise
    relay.join()
    code = outcome.exit_code()
    if code:
        sys.stderr.write(f"Error: {outcome.message(request.hosts)}\n")
    return code


def _relay_stdout(stream) -> None:
    out = sys.stdout.buffer
    for chunk in iter(lambda: stream.read1(65536), b""):
        out.write(chunk)
        out.flush()
