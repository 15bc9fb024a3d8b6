"""Run this very command once per rank and turn what the ranks report into one exit
code and, on failure, one `Error: ...` line.

The ring backend's ranks are started by mlxspec itself (`ranks`, `followers`, with what
`ring` says mlx.launch would give them); the other backends (jaccl, mpi) still run
under `mlx.launch` (`run_launched`), which starts the ranks (over ssh from a hostfile),
relays their output, and stops the others when one fails, but always exits 0 itself; so
every rank prints a marker line with its exit code on stderr, and the owner reads them
(`Outcome`), whoever started the ranks.
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mlxspec.distributed.config import CHILD_ENV, FAULT_ENV, RankConfig
from mlxspec.distributed.errors import DistributedError
from mlxspec.processes import (
    child_env,
    end_group,
    signal_group,
    stop_reason,
    stop_signals,
)

MARKER = re.compile(r"\x1emlxspec-rank-exit (-?\d+) (-?\d+)")
FRONT = re.compile(r"\x1emlxspec-front-pid (\d+) (\S+)")  # rank 0's pid and host
NODE_EXIT = re.compile(r"Node with rank (\d+) (?:exited with code (-?\d+)|was (killed))")
# MLX's own per-socket chatter when a peer goes away; the summary line says it better.
NOISE = re.compile(r"^(\x1b\[\d+m)?\s*(\[ring\]|\[jaccl\]|\[mpi\]|\[WARN\]|\[INFO\]|\x1b\[0m)")
LOST = "lost the connection to another rank"
# mlx.launch, told who owns it (see mlxspec.processes.become_launcher).
LAUNCH = (
    "from mlxspec.processes import become_launcher; become_launcher(); "
    "from mlx._distributed_utils.launch import main; main()"
)
STOP_SECONDS = 5.0  # after a stop signal, what has not ended by then is killed


@dataclass
class LaunchRequest:
    ranks: int | None
    hostfile: str | None
    backend: str
    parallel: str
    timeout: float
    hosts: list[str] = field(default_factory=list)  # ssh names, from the hostfile
    stop_seconds: float = STOP_SECONDS  # from a stop signal to killing what still runs

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


def read_hostfile_envs(path: str) -> dict[str, str]:
    """The hostfile's `envs` ("NAME=value" strings, every rank gets them), as a dict."""
    data = json.loads(Path(path).expanduser().read_text())
    envs = data.get("envs", []) if isinstance(data, dict) else []
    return dict(entry.split("=", 1) for entry in map(str, envs) if "=" in entry)


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
    front_pid: int | None = None  # rank 0's process, once it said so, if on this host

    def read(self, line: str) -> bool:
        """Take in one stderr line; True when it is for the user to see as it comes."""
        if front := FRONT.search(line):
            if front.group(2) == socket.gethostname():
                self.front_pid = int(front.group(1))
            return False
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
    """Run the ranks under mlx.launch, relay their output, return this command's exit
    code. This process owns them all: a stop signal stops them (`LaunchStop`), and on
    every way out nothing of mlx.launch's process group is left running."""
    command = launch_command(request, rank_argv)
    if os.environ.get("MLXSPEC_VERBOSE"):
        write_stderr(f"mlxspec: {' '.join(command)}\n")
    # mlx.launch (jaccl, mpi) relays its stdin to the ranks, polling it every 0.1 s
    # (select): at EOF, as /dev/null is, the poll returns at once and its loop spins a core
    # for the command's life. A pipe held open and never written blocks the poll instead.
    quiet, held_open = os.pipe() if stdin is None else (None, None)
    process = subprocess.Popen(
        command,
        stdin=stdin if stdin is not None else quiet,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=child_env(),
        start_new_session=True,  # one process group: mlx.launch and every local rank
    )
    if quiet is not None:
        os.close(quiet)
    outcome = Outcome(request.size)
    stop = LaunchStop(functools.partial(signal_group, process.pid), outcome, request.stop_seconds)
    relay = threading.Thread(target=_relay_stdout, args=(process.stdout,), daemon=True)
    relay.start()
    with stop_signals(stop.request):
        try:
            for raw in process.stderr:
                line = raw.decode(errors="replace")
                if outcome.read(line) or os.environ.get("MLXSPEC_VERBOSE"):
                    write_stderr(line)
            process.wait()
        finally:
            end_group(process.pid, STOP_SECONDS)  # ranks whose launcher went first
            if held_open is not None:
                os.close(held_open)
    relay.join(STOP_SECONDS)
    return report_failure(outcome, stop, request.hosts)


def report_failure(outcome: Outcome, stop: LaunchStop, hosts: list[str]) -> int:
    """The command's exit code from what the ranks reported; on failure, one line that
    says why (a stop signal's reason first)."""
    code = outcome.exit_code()
    if code:
        write_stderr(f"Error: {stop.reason() or outcome.message(hosts)}\n")
    return code


class LaunchStop:
    """What a stop signal to the owner does: rank 0 is asked to stop (a server first ends
    its requests, then leads the other ranks out), or, before rank 0 has said where it
    runs, every rank at once; whatever still runs `seconds` later is killed. A second
    signal kills at once. `signal_all` sends a signal to every process of the run."""

    def __init__(self, signal_all: Callable[[int], None], outcome: Outcome, seconds: float):
        self.signal_all, self.outcome, self.seconds = signal_all, outcome, seconds
        self.signum: int | None = None

    def request(self, signum: int) -> None:
        if self.signum is not None:
            self.signal_all(signal.SIGKILL)
            return
        self.signum = signum
        try:
            if self.outcome.front_pid is not None:
                os.kill(self.outcome.front_pid, signal.SIGTERM)
            else:
                self.signal_all(signal.SIGTERM)
        except ProcessLookupError:
            pass
        timer = threading.Timer(self.seconds, self.signal_all, (signal.SIGKILL,))
        timer.daemon = True
        timer.start()

    def reason(self) -> str | None:
        """Why the ranks ended, when a signal stopped them."""
        return None if self.signum is None else stop_reason(self.signum)


def write_stderr(text: str) -> None:
    """Write to stderr, which may be gone (SIGHUP: the terminal closed)."""
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def _relay_stdout(stream) -> None:
    out = sys.stdout.buffer
    for chunk in iter(lambda: stream.read1(65536), b""):
        try:
            out.write(chunk)
            out.flush()
        except (OSError, ValueError):  # the terminal or pipe is gone: read on, to the end
            pass
