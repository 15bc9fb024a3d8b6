"""`chat --ranks N | --hostfile H` (ring backend): rank 0 in this very process, ranks
1..N-1 as children that follow it (local processes, or ssh to the hostfile's other hosts).

The Textual chat needs the user's terminal, where mlx.launch would give rank 0 pipes, so
this process joins the ring as rank 0 itself and starts the others as `ring` says
mlx.launch would; it reads the children's stderr as `ranks.LaunchedRanks` reads every
rank's (exit markers, `Error:` lines).

A child that dies, or a watchdog timeout on rank 0, goes through `fail`: the other
children are stopped first (so a collective rank 0 waits in ends instead of hanging),
then the front end hears the reason (`RankSession.on_lost`: the TUI leaves its screen),
or, with none, the process ends at once with one `Error:` line.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable

from mlxspec.distributed.config import RankConfig
from mlxspec.distributed.launch import NOISE, LaunchRequest, Outcome
from mlxspec.distributed.ring import Ring

STOP_SECONDS = 5.0  # a child asked to stop (SIGTERM) gets this long before SIGKILL


class Followers:
    """Ranks 1..N-1 as children of this process. Their stderr is read for exit markers
    and `Error:` lines only (what else they say, rank 0 says too; MLXSPEC_VERBOSE shows
    it), and `finish` turns it and rank 0's own outcome into one exit code and line."""

    def __init__(self, request: LaunchRequest, rank_argv: list[str]):
        self.request, self.rank_argv = request, rank_argv
        self.config = RankConfig(request.backend, request.parallel, request.timeout)
        self.outcome = Outcome(request.size)
        self.children: dict[int, subprocess.Popen] = {}
        self._readers: list[threading.Thread] = []
        self.on_lost: Callable[[str], None] | None = None  # the front end's (see module doc)
        self._stopping = False  # children that end from now on were asked to
        self._lock = threading.Lock()
        self._code: int | None = None  # set once by `finish`
        self.ring: Ring | None = None  # set by `start`

    def start(self) -> None:
        """Write the ring's addresses, join it as rank 0 (this process's environment, read
        by `mx.distributed.init`), and start the other ranks: local children for
        `--ranks`, over ssh for a hostfile's other hosts (rank 0 is its first host, this
        machine), each as mlx.launch's ring launcher starts it (see `ring`)."""
        self.ring = Ring.plan(self.request)
        os.environ.update(MLX_RANK="0", MLX_HOSTFILE=self.ring.write())
        command = [sys.executable, "-m", "mlxspec", *self.rank_argv]
        for rank in range(1, self.request.size):
            self.children[rank] = subprocess.Popen(
                self.ring.argv(rank, command),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,  # rank 0 owns stdout
                stderr=subprocess.PIPE,
                env=self.ring.env(rank),
                start_new_session=True,  # the terminal's Ctrl-C reaches rank 0 only
            )
            reader = threading.Thread(
                target=self._watch, args=(rank,), name=f"mlxspec-rank-{rank}", daemon=True
            )
            reader.start()
            self._readers.append(reader)

    def _watch(self, rank: int) -> None:
        """Read one child's stderr to its end; a child that ends unasked ends the run."""
        child = self.children[rank]
        for raw in child.stderr:
            line = raw.decode(errors="replace")
            if self.outcome.read(line) and os.environ.get("MLXSPEC_VERBOSE"):
                sys.stderr.write(line)
        code = child.wait()
        self.outcome.node_exits.append((rank, str(code)))
        if code != 0 and not self._stopping:
            self.fail(self.outcome.message(self.request.hosts))

    def fail(self, reason: str) -> None:
        """The other ranks are lost (or stuck): stop them all, then let the front end say
        why, or end the process with one line."""
        self.stop()
        if self.on_lost is not None:
            self.on_lost(reason)
        else:
            self.abort(reason)

    def abort(self, reason: str) -> None:
        """End the process now, non-zero: its threads may be stuck in a collective."""
        code = self.finish(1, reason)
        sys.stdout.flush()
        os._exit(code or 1)

    def stop(self) -> None:
        """Ask every child to end (SIGTERM), and kill those that do not in time."""
        self._stopping = True
        running = [child for child in self.children.values() if child.poll() is None]
        for child in running:
            _signal(child, signal.SIGTERM)
        for child in running:
            try:
                child.wait(STOP_SECONDS)
            except subprocess.TimeoutExpired:
                _signal(child, signal.SIGKILL)
                child.wait()

    def finish(self, code: int, error: str | None = None) -> int:
        """Rank 0 ended with `code` (and `error`): wait for the children (they end once
        told there are no more requests) or stop them, write at most one `Error:` line,
        and return the command's exit code. Only the first call decides."""
        with self._lock:
            if self._code is not None:
                return self._code
            self._stopping = True  # a child that fails now is reported below, once
            if code == 0:
                for child in self.children.values():
                    try:
                        child.wait(self.request.timeout)
                    except subprocess.TimeoutExpired:
                        break  # reported below as a rank that ended without reporting
            self.stop()
            self.outcome.codes[0] = code
            if error:
                self.outcome.errors.append(error)
            for reader in self._readers:
                if reader is not threading.current_thread():  # (a reader may call abort)
                    reader.join(STOP_SECONDS)  # their last lines hold the exit markers
            self._code = self.outcome.exit_code()
            if self._code:
                sys.stderr.write(f"Error: {self.outcome.message(self.request.hosts)}\n")
                sys.stderr.flush()
            self.forget_ring()
            return self._code

    def forget_ring(self) -> None:
        """Remove the ring's address file: once every rank has joined, nothing reads it
        again, and a rank 0 killed later (SIGHUP when its terminal closes) cannot
        leave it behind."""
        if self.ring is not None:
            self.ring.forget()


def hide_collective_noise() -> None:
    """MLX's ring backend reports every failed socket operation on file descriptor 2,
    from C++ (a dozen lines when a peer dies); `run_launched` drops them from what the
    ranks write, and rank 0 in this process must too. Descriptor 2 becomes a pipe that a
    thread copies to the terminal without them, while Python's own stderr (our lines, the
    Textual screen) writes to the terminal directly, so no last line waits in the pipe
    when the process ends."""
    terminal = os.dup(2)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)
    sys.stderr.flush()
    sys.stderr = sys.__stderr__ = open(  # for the life of the process
        terminal, "w", buffering=1, encoding="utf-8", errors="backslashreplace"
    )

    def copy() -> None:
        with open(read_end, "rb") as native:
            for raw in native:
                if not NOISE.match(raw.decode(errors="replace")):
                    os.write(terminal, raw)

    threading.Thread(target=copy, name="mlxspec-stderr", daemon=True).start()


def _signal(child: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(child.pid, signum)  # the child leads its own session (start_new_session)
    except ProcessLookupError:
        pass
