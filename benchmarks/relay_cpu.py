"""What the ranks' launcher or relay costs while a sharded `generate` runs (issue 51), and
what the ranks then get done: sharded plain against prompt lookup on the copy prompt.

    python benchmarks/relay_cpu.py                       # this checkout, 3 ranks, 2 turns
    python benchmarks/relay_cpu.py --tree /tmp/before    # another checkout's mlxspec

Each turn runs `mlxspec generate PROMPT -n 24 --ranks R --json -p none`, then the same
with `-p prompt-lookup`, samples /proc every 0.1 s for the CPU time of every process of
the run that is not a rank (the command's own process, and mlx.launch's where it runs;
a rank has MLX_RANK in its environment), and prints the wall time, that CPU as a share
of one core over the ranks' lifetime, and the record's decode tokens/s. Uses the default
model and the cached sharded calibration (`MLXSPEC_CACHE` as set).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# The prompt SmolLM2 copies for the whole answer (tests/test_numbers.py's). An answer that
# leaves the prompt's text caps prompt lookup at completion tokens / rounds: the earlier
# "Repeat exactly: the quick brown fox ..." was copied for 10 tokens of 24, 17 rounds, a
# ceiling of 1.41x whatever the ranks cost.
PROMPT = (
    "Copy this text exactly, word for word:\n\nThe quick brown fox jumps over the lazy dog. "
    "The five boxing wizards jump quickly. Pack my box with five dozen liquor jugs. How "
    "vexingly quick daft zebras jump. Sphinx of black quartz, judge my vow."
)
TICKS = os.sysconf("SC_CLK_TCK")


def stat_fields(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def family(root: int) -> list[int]:
    """`root`'s live descendants, from one scan of /proc."""
    parents: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        if fields := stat_fields(int(entry)):
            parents.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [root]
    while todo:
        kids = parents.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def is_rank(pid: int) -> bool:
    try:
        return b"\0MLX_RANK=" in b"\0" + Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False


def run(tree: str, ranks: int, proposer: str) -> dict:
    """One sharded generate: wall seconds, relay CPU share, decode tok/s."""
    env = {**os.environ, "PYTHONPATH": tree}
    env.pop("OPENBLAS_NUM_THREADS", None)  # the ranks' own choice (`blas.share_cores`)
    command = [sys.executable, "-m", "mlxspec", "generate", PROMPT, "-n", "24", "--json"]
    command += ["--ranks", str(ranks), "-p", proposer]
    start = time.monotonic()
    owner = subprocess.Popen(command, env=env, cwd=tree, stdout=subprocess.PIPE, text=True)
    relay: dict[int, float] = {}
    first = last = None
    while owner.poll() is None:
        members = family(owner.pid)
        rank_pids = [pid for pid in members if is_rank(pid)]
        for pid in [owner.pid, *(p for p in members if p not in rank_pids)]:
            if fields := stat_fields(pid):
                relay[pid] = (int(fields[11]) + int(fields[12])) / TICKS
        if len(rank_pids) == ranks:
            reading = (time.monotonic(), sum(relay.values()))
            first, last = first or reading, reading
        time.sleep(0.1)
    out = owner.communicate()[0]
    wall = time.monotonic() - start
    record = json.loads(out)["record"]
    tokens = max(record["completion_tokens"] - record["first_round_tokens"], 0)
    share = (last[1] - first[1]) / max(last[0] - first[0], 1e-9) if first else float("nan")
    return {
        "rounds": record.get("collective_rounds", 0),
        "tokens": record["completion_tokens"],
        "wall": wall,
        "relay_share": share,
        "decode_tok_s": tokens / record["decode_seconds"] if record["decode_seconds"] else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", help="checkouts to compare (default: this)")
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--turns", type=int, default=2)
    args = parser.parse_args()
    trees = args.tree or [str(Path(__file__).resolve().parent.parent)]
    for turn in range(args.turns):
        for tree in trees if turn % 2 == 0 else reversed(trees):
            rows = {p: run(tree, args.ranks, p) for p in ("none", "prompt-lookup")}
            plain, lookup = rows["none"], rows["prompt-lookup"]
            print(
                f"turn {turn + 1} {tree}: "
                + "; ".join(
                    f"{p}: {r['wall']:.1f} s wall, relay {r['relay_share']:.0%} of a core, "
                    f"{r['decode_tok_s']:.2f} tok/s ({r['tokens']} tokens in {r['rounds']} rounds)"
                    for p, r in rows.items()
                )
                + f"; lookup/plain {lookup['decode_tok_s'] / plain['decode_tok_s']:.2f}x",
                flush=True,
            )


if __name__ == "__main__":
    main()
