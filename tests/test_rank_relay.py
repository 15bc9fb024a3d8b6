"""What carries the ranks' output costs next to nothing while they run (issue 51).

mlx.launch's relay polled every rank's stdin pipe for writability (always true) and its
own stdin at end of file (always readable), so its loop never slept: 40-90 % of a core
of a 2-core machine, taken from the ranks. This test runs a short sharded `generate` and
holds the CPU time of every process that is not a rank (the command's own process and
whatever it starts to carry the ranks' output) to a few percent of the ranks' lifetime.
CPU time, read from /proc, not speed: a loaded machine slows the run but not the ratio.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_distributed import save_model
from tiny_models import FAMILIES, tiny_model

TICKS = os.sysconf("SC_CLK_TCK")
RELAY_SHARE = 0.05  # of one core, over the ranks' lifetime
POLL_SECONDS = 0.1

# Ranks fill both cores, and the launcher's CPU share is measured (tests/side_by_side.py).
pytestmark = [
    pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc"),
    pytest.mark.alone,
]


def cpu_seconds(pid: int) -> float | None:
    """User plus system CPU time of one process, or None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime


def children_of(pid: int) -> list[int]:
    """Every live descendant of `pid` (a scan of /proc, no subprocess per poll)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            parents.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def environ(pid: int) -> bytes:
    """A process's environment, NUL-separated with a leading NUL (so that a whole name
    matches: b"\0MLX_RANK=0\0"); empty once the process is gone."""
    try:
        return b"\0" + Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return b""


def is_rank(pid: int) -> bool:
    """A rank is started with MLX_RANK in its environment; a launcher or relay is not."""
    return b"\0MLX_RANK=" in environ(pid)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("relay")
    save_model(tiny_model("llama", seed=3), FAMILIES["llama"], root / "llama")
    (root / "models.toml").write_text('default = "tiny"\n[models.tiny]\ntarget = "./llama"\n')
    return root


def test_the_relay_sleeps_while_the_ranks_run(tiny):
    env = {**os.environ, "MLXSPEC_MODELS": str(tiny / "models.toml")}
    env |= {"MLXSPEC_CACHE": str(tiny / "cache")}
    env.pop("MLXSPEC_FAULT", None)
    env.pop("OPENBLAS_NUM_THREADS", None)  # the ranks share the cores by themselves
    command = [sys.executable, "-m", "mlxspec", "generate", "abc abc abc abc", "--raw"]
    command += ["-n", "64", "-p", "none", "--k", "0", "--ranks", "2"]
    owner = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    relay_cpu: dict[int, float] = {}  # the last reading of every non-rank process
    first = last = None  # (wall, relay CPU) with both ranks up, first and last seen
    try:
        deadline = time.monotonic() + 120
        while owner.poll() is None and time.monotonic() < deadline:
            family = children_of(owner.pid)
            ranks = [pid for pid in family if is_rank(pid)]
            for pid in [owner.pid, *(pid for pid in family if pid not in ranks)]:
                if (seconds := cpu_seconds(pid)) is not None:
                    relay_cpu[pid] = seconds
            if len(ranks) == 2:
                reading = (time.monotonic(), sum(relay_cpu.values()))
                first, last = first or reading, reading
            time.sleep(POLL_SECONDS)
        out, err = owner.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if owner.poll() is None:
            os.killpg(owner.pid, 9)
            owner.wait()
    assert owner.returncode == 0, err.decode()
    assert out.strip(), "the ranks' answer was relayed"
    assert first and last and last[0] - first[0] > 1.0, "the ranks ran too briefly to measure"
    share = (last[1] - first[1]) / (last[0] - first[0])
    assert share < RELAY_SHARE, (
        f"the launcher/relay used {share:.0%} of a core while the ranks ran "
        f"({last[1] - first[1]:.2f} s CPU in {last[0] - first[0]:.1f} s)"
    )


def test_generate_over_a_hostfile_starts_every_rank_over_ssh(tiny, tmp_path):
    """`generate --hostfile` (ring): every host's rank, rank 0's too, starts over ssh as
    mlx.launch started it, with the hostfile's `envs`; the answer is relayed and equals
    `--ranks 2`'s. `ssh` is a stand-in on PATH that runs the remote line here."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    called, lines = tmp_path / "ssh-called", tmp_path / "ssh-lines"
    fake_ssh = bin_dir / "ssh"
    fake_ssh.write_text(
        "#!/bin/bash\n"
        'while [[ "$1" == -* ]]; do shift 2; done  # options and their values\n'
        f'echo "$1" >> {shlex.quote(str(called))}; shift\n'
        f'echo "$1" >> {shlex.quote(str(lines))}\n'
        'exec bash -c "$1"\n'
    )
    fake_ssh.chmod(0o755)
    hosts = tmp_path / "hosts.json"
    pair = [{"ssh": "mac1", "ips": ["127.0.0.1"]}, {"ssh": "mac2", "ips": ["127.0.0.1"]}]
    hosts.write_text(json.dumps({"hosts": pair, "envs": ["HOSTS_WIDE=1"]}))
    env = {**os.environ, "MLXSPEC_MODELS": str(tiny / "models.toml")}
    env |= {"MLXSPEC_CACHE": str(tiny / "cache")}
    env |= {"PATH": f"{bin_dir}:{env['PATH']}"}
    env.pop("MLXSPEC_FAULT", None)
    env.pop("OPENBLAS_NUM_THREADS", None)  # the ranks share the cores by themselves
    run = [sys.executable, "-m", "mlxspec", "generate", "abc abc abc abc", "--raw", "-n", "16"]
    run += ["-p", "none", "--k", "0"]
    answers = [
        subprocess.run([*run, *args], capture_output=True, text=True, env=env, timeout=120)
        for args in (["--ranks", "2"], ["--hostfile", str(hosts)])
    ]
    assert all(done.returncode == 0 for done in answers), answers[1].stderr
    assert answers[1].stdout == answers[0].stdout and answers[0].stdout.strip()
    # Both started (in either order: two processes racing to append, seen mac2 first
    # under load).
    assert sorted(called.read_text().split()) == ["mac1", "mac2"]
    assert lines.read_text().count("export HOSTS_WIDE=1;") == 2
