"""Every rank of a ring run as a child of the process the user started, its output
carried by threads that sleep until a rank writes (issue 51).

mlx.launch's relay never slept: each rank's thread `select()`ed with the rank's stdin
pipe in its write set (an empty pipe is always writable) and its main loop `select()`ed
on a stdin at end of file (always readable), so it took 40-90 % of a core from the ranks
for the whole run. Here each rank's stdout and stderr have one thread each, blocked in
`read` until the rank writes; stdin needs no relay at all: rank 0 gets this process's
stdin as its own, the others none (mlx.launch copied it to every rank; only rank 0
reads it).

What mlx.launch did and this keeps: every rank's stdout reaches ours, its stderr goes
through `Outcome` (exit markers, `Error:` lines, MLX's socket chatter dropped), a rank
that fails stops the others (SIGTERM, then SIGKILL), and a stop signal to this process
goes to rank 0, which leads the others out (`LaunchStop`). Each rank leads a session of
its own, so a terminal's Ctrl-C reaches this process only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from mlxspec.distributed.launch import (
    STOP_SECONDS,
    LaunchRequest,
    LaunchStop,
    Outcome,
    report_failure,
    write_stderr,
)
from mlxspec.distributed.ring import HOSTFILE_PORT, Ring
from mlxspec.processes import signal_group, stop_signals


class LaunchedRanks:
    """The ranks of one run, as children of this process, and their output."""

    def __init__(self, request: LaunchRequest, rank_argv: list[str], stdin=None):
        self.request, self.stdin = request, stdin
        self.command = [sys.executable, "-m", "mlxspec", *rank_argv]
        self.ring = Ring.plan(request, HOSTFILE_PORT)  # mlx.launch's ports on hosts
        self.outcome = Outcome(request.size)
        self.children: dict[int, subprocess.Popen] = {}
        self._threads: list[threading.Thread] = []
        self._out_lock = threading.Lock()  # one rank's chunk at a time on our stdout
        self._stopping = False  # ranks that end from now on were told to

    def start(self) -> None:
        """Start every rank (as `ring` says mlx.launch would) and its two readers."""
        self.ring.write()
        for rank in range(self.request.size):
            argv = self.ring.argv(rank, self.command)
            if os.environ.get("MLXSPEC_VERBOSE"):
                write_stderr(f"mlxspec: rank {rank}: {' '.join(argv)}\n")
            self.children[rank] = subprocess.Popen(
                argv,
                stdin=self.stdin if rank == 0 and self.stdin is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=self.ring.env(rank),
                start_new_session=True,  # Ctrl-C reaches this process, which decides
            )
            for target in (self._copy_stdout, self._read_stderr):
                thread = threading.Thread(
                    target=target, args=(rank,), name=f"mlxspec-rank-{rank}", daemon=True
                )
                thread.start()
                self._threads.append(thread)

    def wait(self) -> None:
        """Until every rank has ended and its output has been read to the end."""
        for thread in self._threads:
            thread.join()

    def signal_all(self, signum: int) -> None:
        for child in self.children.values():
            signal_group(child.pid, signum)  # each rank leads its own group

    def end(self, seconds: float) -> None:
        """Make sure no rank runs on: SIGTERM, and SIGKILL for those still there after
        `seconds`; the address file goes too."""
        self._stopping = True
        running = [child for child in self.children.values() if child.poll() is None]
        if running:
            self.signal_all(signal.SIGTERM)
            deadline = time.monotonic() + seconds
            while any(c.poll() is None for c in running) and time.monotonic() < deadline:
                time.sleep(0.05)
            self.signal_all(signal.SIGKILL)
        self.ring.forget()

    def _copy_stdout(self, rank: int) -> None:
        """Copy one rank's stdout to ours as it comes (blocking reads: no polling)."""
        stream, out = self.children[rank].stdout, sys.stdout.buffer
        for chunk in iter(lambda: stream.read1(65536), b""):
            with self._out_lock:
                try:
                    out.write(chunk)
                    out.flush()
                except (OSError, ValueError):  # the terminal or pipe is gone: read on
                    pass

    def _read_stderr(self, rank: int) -> None:
        """Read one rank's stderr to its end, then its exit code; a rank that fails
        unasked stops the others, as mlx.launch did."""
        child = self.children[rank]
        verbose = bool(os.environ.get("MLXSPEC_VERBOSE"))
        for raw in child.stderr:
            line = raw.decode(errors="replace")
            if self.outcome.read(line) or verbose:
                write_stderr(line)
        code = child.wait()
        self.outcome.node_exits.append((rank, str(code)))
        if code != 0 and not self._stopping:
            self._stopping = True
            stopper = threading.Thread(target=self.end, args=(STOP_SECONDS,), daemon=True)
            stopper.start()


def run_ranks(request: LaunchRequest, rank_argv: list[str], stdin=None) -> int:
    """Run a ring's ranks as this process's children, relay their output, and return
    this command's exit code (with one `Error:` line on failure). On every way out no
    rank is left running."""
    ranks = LaunchedRanks(request, rank_argv, stdin)
    stop = LaunchStop(ranks.signal_all, ranks.outcome, request.stop_seconds)
    with stop_signals(stop.request):
        try:
            ranks.start()
            ranks.wait()
        finally:
            ranks.end(STOP_SECONDS)
    return report_failure(ranks.outcome, stop, request.hosts)
