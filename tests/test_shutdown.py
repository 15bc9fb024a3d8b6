"""Every process a command starts ends when the command is stopped, by any signal.

Each test starts the real command in its own process group, notes every process it
started (its descendants, once it is up), stops it the way a terminal, a service manager
or a script does (SIGINT, SIGTERM, SIGHUP, SIGKILL), and watches the process table: no
process it started may survive, and its port must bind again. Whatever happens, the
test kills what is left on its way out.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from terminal import Terminal, needs_tmux
from test_distributed import (
    LOADED,
    TRIO,
    chat_in_terminal,
    descendants,
    save_model,
)
from tiny_models import FAMILIES, tiny_model

from mlxspec.distributed.launch import Outcome

# Commands on ranks run alone (tests/side_by_side.py): their ranks fill both cores, and
# they stop within bounds in seconds. A one-process command's stop is a signal handler and
# a socket closed, well inside its bound beside the other worker.
RANKS = pytest.mark.alone

GONE_SECONDS = 10.0  # the bound: after a stop signal, nothing left and the port free
STOPS = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """A models.toml with a tiny llama (2 ranks split it) and one 3 ranks split."""
    root = tmp_path_factory.mktemp("shutdown")
    save_model(tiny_model("llama", seed=3), FAMILIES["llama"], root / "llama")
    save_model(tiny_model("llama", seed=6, config=TRIO), TRIO, root / "trio")
    (root / "models.toml").write_text(
        'default = "tiny"\n'
        '[models.tiny]\ntarget = "./llama"\n'
        "[models.tiny.defaults]\nmax_tokens = 32\n"
        "[models.tiny.proposers.prompt-lookup]\nk_max = 8\n"
        '[models.trio]\ntarget = "./trio"\n'
        "[models.trio.defaults]\nmax_tokens = 32\n"
        "[models.trio.proposers.prompt-lookup]\nk_max = 8\n"
    )
    (root / "cache").mkdir()
    subprocess.run([sys.executable, "-c", SEED, str(root / "cache")], check=True, timeout=60)
    return root


# A flat verify-cost curve for every setup the tests run, as a calibration would store it
# (see test_distributed.seed_flat_calibration), keyed in a fresh process as the commands
# key it (the key names how BLAS was loaded): a stop never waits on a calibration.
SEED = """
import json, sys
from pathlib import Path
import mlxspec
from mlxspec.distributed.rank import rank_setup
from mlxspec.decoding.verify_cost import VerifyCost, calibration_key

flat = VerifyCost({1: 1.0, 64: 1.0}, step_seconds=0.01).to_json()
tiny, trio = ("tiny", "float32"), ("trio", "float32")  # float32 folders, kept as float32
keys = [calibration_key(*tiny), calibration_key(*tiny, rank_setup("tensor", 2, "ring"))]
keys.append(calibration_key(*trio, rank_setup("tensor", 3, "ring")))
(Path(sys.argv[1]) / "calibration.json").write_text(json.dumps(dict.fromkeys(keys, flat)))
"""


def environment(root: Path) -> dict[str, str]:
    env = {**os.environ, "MLXSPEC_MODELS": str(root / "models.toml")}
    env |= {"MLXSPEC_CACHE": str(root / "cache")}
    env.pop("MLXSPEC_FAULT", None)
    env.pop("OPENBLAS_NUM_THREADS", None)  # the ranks share the cores by themselves
    return env


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def port_binds(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a server binds it
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def running(pid: int) -> bool:
    """Whether a process still runs (a zombie, dead but not reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def survivors(pids: list[int], seconds: float) -> list[str]:
    """The processes of `pids` still running after up to `seconds` (pid and command)."""
    deadline = time.monotonic() + seconds
    while (left := [pid for pid in pids if running(pid)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [f"{pid}: {command_line(pid)}" for pid in left]


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()[:120].replace(b"\0", b" ").decode()
    except OSError:
        return "(gone)"


@contextmanager
def started(command: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen]:
    """The command in a process group of its own; on the way out every process it
    started (noted in `owner.family`) and its group are killed, whatever happened."""
    with open(log, "w") as stderr:
        owner = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            env=env,
            start_new_session=True,
        )
    owner.family = []
    try:
        yield owner
    finally:
        for pid in [*owner.family, *descendants(owner.pid)]:
            kill(pid)
        kill(owner.pid, group=True)
        owner.wait(10)


def kill(pid: int, group: bool = False) -> None:
    """SIGKILL to a process (or its group) that may be gone already."""
    try:
        (os.killpg if group else os.kill)(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def wait_until_serving(owner: subprocess.Popen, port: int, log: Path, seconds: float = 180):
    """Up to the moment /health answers, with the model loaded."""
    deadline = time.monotonic() + seconds
    while True:
        assert owner.poll() is None, log.read_text()
        assert time.monotonic() < deadline, "the server did not come up: " + log.read_text()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").json()["model"]:
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.3)


def serve(port: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "mlxspec", "serve", "--port", str(port), *args]


# --- the owner's side, no processes ------------------------------------------------------------


def test_the_owner_signals_rank_0_only_where_it_runs_on_this_host():
    """Rank 0's pid marker steers the owner's stop signal to it (it leads the others out);
    a rank 0 on another host cannot be signalled by pid from here."""
    outcome = Outcome(3)
    assert not outcome.read("\x1emlxspec-front-pid 123 another-host\n")  # not for the user
    assert outcome.front_pid is None
    outcome.read(f"\x1emlxspec-front-pid 456 {socket.gethostname()}\n")
    assert outcome.front_pid == 456


# --- any helper: it ends with its owner ---------------------------------------------------------


def test_a_helper_ends_when_its_owner_is_killed():
    """A helper started as `owned_python` (as `pull` starts pip): its owner killed with
    SIGKILL, which no handler sees, the helper notices its parent is gone and ends."""
    script = (
        "import subprocess, time\n"
        "from mlxspec.processes import child_env, owned_python\n"
        "helper = subprocess.Popen([*owned_python('http.server'), '--bind', '127.0.0.1', '0'],"
        " env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "print(helper.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    helper = int(owner.stdout.readline())
    try:
        time.sleep(1.5)  # the helper is serving
        assert running(helper)
        owner.kill()
        owner.wait(5)
        left = survivors([helper], 3)
    finally:
        kill(owner.pid, group=True)  # the helper shares the owner's group
    assert not left, "the helper outlived its owner"


# --- serve: one process ------------------------------------------------------------------------


@pytest.mark.parametrize("stop", STOPS, ids=lambda s: s.name)
def test_serve_stops_cleanly_on_each_signal(models, tmp_path, stop):
    """SIGINT, SIGTERM and SIGHUP each stop `serve` with exit 0 and free its port."""
    port, log = free_port(), tmp_path / "serve.log"
    with started(serve(port, "--model", "tiny"), environment(models), log) as owner:
        wait_until_serving(owner, port, log)
        owner.send_signal(stop)
        try:
            code = owner.wait(GONE_SECONDS)
        except subprocess.TimeoutExpired:
            pytest.fail(f"serve still runs {GONE_SECONDS:g} s after {stop.name}")
        assert code == 0, log.read_text()
        assert port_binds(port)
        assert "Traceback" not in log.read_text()


# --- serve --ranks 3: the launcher and every rank go with it ------------------------------------


def serving_three_ranks(models: Path, tmp_path: Path, *args: str):
    port, log = free_port(), tmp_path / "serve.log"
    command = serve(port, "--model", "trio", "--ranks", "3", *args)
    return port, log, started(command, environment(models), log)


@RANKS
def test_serve_on_three_ranks_leaves_nothing_running_on_a_stop_signal(models, tmp_path):
    """The issue's case: a stop signal to the process the user started ends all three
    ranks (its children), frees the port, and the command exits 0, within 10 s.

    One signal here: the launcher turns SIGINT, SIGTERM and SIGHUP into the same stop
    (`stop_signals`, `LaunchStop.request`), and each signal reaching that handler is
    tested on the one-process serve above; generate and chat on ranks stop by SIGHUP."""
    stop = signal.SIGTERM
    port, log, context = serving_three_ranks(models, tmp_path)
    with context as owner:
        wait_until_serving(owner, port, log)
        owner.family = descendants(owner.pid)
        assert len(owner.family) >= 3, owner.family  # three ranks
        start = time.monotonic()
        owner.send_signal(stop)
        left = survivors([owner.pid, *owner.family], GONE_SECONDS)
        assert not left, f"{stop.name}, {GONE_SECONDS:g} s later: {left}\n{log.read_text()}"
        assert port_binds(port)
        assert owner.wait(1) == 0, log.read_text()
        assert time.monotonic() - start < GONE_SECONDS


@RANKS
@pytest.mark.parametrize("killed", ["owner", "owner-and-rank-0"])
def test_serve_on_three_ranks_killed_owner_leaves_nothing_running(models, tmp_path, killed):
    """SIGKILL reaches no handler: the ranks notice their parent, the owner, is gone and
    end on their own, also when a rank died with it, well within the collective timeout
    (60 s here, so that no watchdog does it for them)."""
    port, log, context = serving_three_ranks(models, tmp_path, "--collective-timeout", "60")
    with context as owner:
        wait_until_serving(owner, port, log)
        owner.family = descendants(owner.pid)
        assert len(owner.family) >= 3, owner.family  # three ranks, rank 0 first
        owner.kill()
        if killed == "owner-and-rank-0":
            kill(owner.family[0])
        left = survivors(owner.family, GONE_SECONDS)
        assert not left, f"still running after the owner was killed: {left}\n{log.read_text()}"
        assert port_binds(port)


@pytest.mark.parametrize(
    "ranks", [None, pytest.param("3", marks=RANKS)], ids=["one-process", "three-ranks"]
)
def test_sigterm_during_four_streams_ends_each_clearly_and_exits_0(models, tmp_path, ranks):
    """Four clients stream long answers; SIGTERM with --shutdown-timeout 1: each stream
    ends with a final event that says the server is stopping (not a cut connection, not
    a hang), the port is free again and the command exits 0."""
    port, log = free_port(), tmp_path / "serve.log"
    args = ["--shutdown-timeout", "1", "--max-batch", "4"]
    model = "tiny" if ranks is None else "trio"
    args += ["--model", model] + ([] if ranks is None else ["--ranks", ranks])
    with started(serve(port, *args), environment(models), log) as owner:
        wait_until_serving(owner, port, log)
        owner.family = descendants(owner.pid)
        url = f"http://127.0.0.1:{port}/v1/completions"
        streaming = []

        def stream(prompt: str) -> list[str]:
            body = {"model": model, "prompt": prompt, "max_tokens": 4000, "stream": True}
            body["temperature"] = 0
            lines = []
            with httpx.stream("POST", url, json=body, timeout=60) as response:
                assert response.status_code == 200, response.read()
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line[len("data: ") :])
                        if len(lines) == 2:
                            streaming.append(prompt)
            return lines

        with ThreadPoolExecutor(4) as pool:
            prompts = ["ab ab ab", "cd cd cd", "ef ef ef", "gh gh gh"]
            futures = [pool.submit(stream, prompt) for prompt in prompts]
            deadline = time.monotonic() + 60
            while len(streaming) < 4 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert len(streaming) == 4, "the four streams did not start"
            owner.send_signal(signal.SIGTERM)
            answers = [future.result() for future in futures]  # a cut connection raises here
        for lines in answers:
            last = json.loads(lines[-1])
            assert last["error"]["code"] == "shutting_down", lines[-3:]
        assert owner.wait(GONE_SECONDS) == 0, log.read_text()
        assert not survivors(owner.family, 1)
        assert port_binds(port)


# --- generate --ranks and chat --ranks ----------------------------------------------------------


@RANKS
def test_generate_on_two_ranks_mid_answer_leaves_nothing_running(models, tmp_path):
    """A stop signal while the ranks generate (SIGHUP: the terminal closed; SIGTERM takes
    the same handler, tested on serve --ranks 3): every process ends within 10 s, and the
    command says in one line why it stopped."""
    stop = signal.SIGHUP
    log = tmp_path / "generate.log"
    command = [sys.executable, "-m", "mlxspec", "generate", "ab ab ab", "--raw", "-n", "100000"]
    command += ["--ranks", "2", "--model", "tiny"]
    out = tmp_path / "generate.out"
    env = environment(models)
    with started(["bash", "-c", f'exec "$@" > {out}', "-", *command], env, log) as owner:
        deadline = time.monotonic() + 90
        while not (out.exists() and out.stat().st_size > 20):  # the answer is streaming
            assert owner.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        owner.family = descendants(owner.pid)
        assert len(owner.family) >= 2, owner.family  # two ranks
        owner.send_signal(stop)
        left = survivors([owner.pid, *owner.family], GONE_SECONDS)
        assert not left, f"still running {GONE_SECONDS:g} s after {stop.name}: {left}"
        errors = [line for line in log.read_text().splitlines() if line.startswith("Error: ")]
        assert errors == [f"Error: stopped by {stop.name}"], log.read_text()
        assert owner.wait(1) == 1


@needs_tmux
@RANKS
def test_chat_on_two_ranks_in_a_terminal_leaves_nothing_running(models, tmp_path):
    """`chat --ranks 2` in a terminal (rank 0 is the process the user started) stopped
    by SIGHUP, as when the terminal closes: every rank ends. (SIGTERM and SIGINT reach the
    same `stop_signals` handler, each tested on the one-process serve.)"""
    stop = signal.SIGHUP
    args = ("--ranks", "2", "-p", "prompt-lookup")
    with Terminal(chat_in_terminal(models, tmp_path / "data", *args)) as term:
        screen = term.wait_for(lambda s: LOADED in s, 60)
        assert LOADED in screen, screen
        (owner,) = descendants(term.pane_pid())[:1]
        family = descendants(owner)
        assert family, "rank 1 is the chat's child"
        os.kill(owner, stop)
        try:
            left = survivors([owner, *family], GONE_SECONDS)
        finally:
            for pid in [owner, *family]:
                kill(pid)
        assert not left, f"still running {GONE_SECONDS:g} s after {stop.name}: {left}"


@needs_tmux
@RANKS
def test_chat_on_two_ranks_killed_owner_leaves_nothing_running(models, tmp_path):
    """The chat's process killed (SIGKILL): rank 1, its child, ends on its own."""
    args = ("--ranks", "2", "-p", "prompt-lookup", "--collective-timeout", "60")
    with Terminal(chat_in_terminal(models, tmp_path / "data", *args)) as term:
        assert LOADED in term.wait_for(lambda s: LOADED in s, 60)
        (owner,) = descendants(term.pane_pid())[:1]
        family = descendants(owner)
        assert family, "rank 1 is the chat's child"
        os.kill(owner, signal.SIGKILL)
        try:
            left = survivors(family, GONE_SECONDS)
        finally:
            for pid in family:
                kill(pid)
        assert not left, f"rank 1 still runs after the chat was killed: {left}"
