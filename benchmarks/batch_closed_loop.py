"""Batched speculation against batched plain, engine only: B slots kept full from a queue.

    python benchmarks/batch_closed_loop.py --requests 32 -n 48 --methods none,prompt-lookup
    python benchmarks/batch_closed_loop.py --methods none,prompt-lookup,suffix \
        --row-floor 0.95 --row-floor 0
    python benchmarks/batch_closed_loop.py --methods none,prompt-lookup,prompt-lookup@tree

The scheduler runs `--batch` slots; each finished request is replaced by the next one of
`--requests` (the shipped code, summarize and chat suites, cycled), as clients in a closed
loop would. Prints each method's tokens/s, verify rounds and the widths the batch chose.
The rounds matter beside the time: a batch runs as many rounds as its slowest slot
needs, so only a queue longer than the batch shows what speculation saves. No server, no
HTTP; `mlxspec bench --concurrency` measures through the API. Compare ratios within one
run: the methods run in turn in this process.

Per prompt class it also prints each method's decode pace against batched plain,
measured inside the same run: a class's tokens over the passes its rows sat in, each
pass timed in units of the batch's own latest plain pass over as many rows (the
scheduler re-times one at least every 32 passes, `PassCost.wants_plain`), then over the
same figure for the `none` run (batched plain: one token per row and pass, about 1.0 by
this measure). A machine that is busier in one part of the run than another shifts
both sides of each pass's ratio. A client
-side pace (`bench --concurrency`) mixes in which requests happen to run while the
batch drains; this does not.

Last, each run's time outside the verify passes (prefill, drafting, bookkeeping) and its
plain passes' mean cost by rows: on a CPU the prefill, which batching cannot share, is
what keeps the whole run's gain below the decode rounds' own.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import mlxspec  # noqa: F401  (OpenBLAS before mlx.core)
from mlxspec.batch.scheduler import Scheduler
from mlxspec.batch.width import ROW_FLOOR
from mlxspec.bench.suites import load_suite
from mlxspec.decoding.engine import GenerationSettings
from mlxspec.events import Accepted, Bonus, Corrected, Done
from mlxspec.registry.models_toml import NONE, load_registry
from mlxspec.registry.runtime import Runtime, open_runtime
from mlxspec.suffix.store import HistoryStore

TREE = "@tree"  # a method NAME@tree drafts a tree a round (`--tree` of generate)


@dataclass
class Pace:
    """Per prompt class: tokens its rows kept, and the passes they sat in, in plain passes."""

    tokens: Counter = field(default_factory=Counter)
    passes: defaultdict = field(default_factory=lambda: defaultdict(float))

    def versus_plain(self) -> dict[str, float]:
        return {kind: self.tokens[kind] / self.passes[kind] for kind in sorted(self.passes)}


@dataclass
class Split:
    """Where a run's time went: inside the verify passes or outside them (prefill above
    all: rounds that take in a prompt feed it before their pass), and what a plain pass
    cost by rows, so the batch's ceiling can be told from its scheduling."""

    outside: float = 0.0
    plain: defaultdict = field(default_factory=lambda: defaultdict(list))  # rows -> seconds
    tree_rounds: int = 0  # rounds where some row verified a tree (NAME@tree methods)

    def line(self) -> str:
        means = ", ".join(
            f"{rows} rows {1000 * sum(t) / len(t):.0f} ms" for rows, t in sorted(self.plain.items())
        )
        trees = f"; {self.tree_rounds} rounds verified a tree" if self.tree_rounds else ""
        return f"{self.outside:.1f} s outside the passes; plain pass over {means}{trees}"


def closed_loop(
    runtime: Runtime, method: str, prompts, args, row_floor: float = ROW_FLOOR
) -> tuple[float, int, int, Counter, Pace, Split]:
    """Seconds, tokens, rounds, the round widths, the per-class pace and the time split of
    one run.

    Each run reads and feeds a history of its own, empty at the start, as `bench` does:
    the user's store would hand suffix the answers of earlier runs of these very prompts
    (seen: 1,152 tokens in 21 rounds)."""
    runtime.use_history(HistoryStore(Path(tempfile.mkdtemp(prefix="mlxspec-loop-"))))
    name, tree = method.removesuffix(TREE), method.endswith(TREE)
    proposer = runtime.proposer(name) if name != NONE else NONE
    scheduler = Scheduler(runtime.engine, max_batch=args.batch, row_floor=row_floor)
    queue = [prompts[i % len(prompts)] for i in range(args.requests)]
    settings = GenerationSettings(max_tokens=args.n, tree=tree)
    widths: Counter = Counter()
    truncate, observe = scheduler._truncate, scheduler.pass_cost.observe
    kinds: dict[int, str] = {}
    this_round: dict = {}

    def counted(rounds):
        cut = truncate(rounds)
        widths[max(len(r.tree) for r in cut)] += 1
        split.tree_rounds += any(not r.tree.is_chain for r in cut)
        this_round["rows"] = [kinds[slot.request_id] for slot in scheduler.active]
        return cut

    def timed(rows: int, columns: int, seconds: float) -> None:
        cost = scheduler.pass_cost
        plain = cost.plain_seconds.get(rows)
        observe(rows, columns, seconds)
        this_round["pass"] = seconds
        if columns == 1:
            split.plain[rows].append(seconds)
        plain = plain or cost.plain_seconds.get(rows)  # this very pass, if plain
        # No plain pass over these rows timed yet: the batch's own price of this one.
        this_round["plain_passes"] = (
            seconds / plain if plain else cost(rows, columns) / cost(rows, 1)
        )

    scheduler._truncate, scheduler.pass_cost.observe = counted, timed
    pace, split = Pace(), Split()

    def submit() -> None:
        prompt = queue.pop(0)
        chat = [{"role": "user", "content": prompt.text}]
        kinds[scheduler.submit(chat, settings, proposer)] = prompt.kind

    for _ in range(min(args.batch, len(queue))):
        submit()
    start, tokens, rounds = time.perf_counter(), 0, 0
    while scheduler.busy:
        this_round.clear()
        began = time.perf_counter()
        out = scheduler.step()
        split.outside += time.perf_counter() - began - this_round.get("pass", 0.0)
        rounds += 1
        for kind in this_round.get("rows", []):
            pace.passes[kind] += this_round["plain_passes"]
        for request_id, events in out.items():
            made = sum(len(e.tokens) for e in events if isinstance(e, Accepted | Bonus | Corrected))
            tokens += made
            pace.tokens[kinds[request_id]] += made
            if queue and any(isinstance(e, Done) for e in events):
                submit()
    return time.perf_counter() - start, tokens, rounds, widths, pace, split


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--suites", default="code,summarize,chat")
    parser.add_argument("-n", type=int, default=48, help="new tokens per request")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--methods", default="none,prompt-lookup")
    parser.add_argument(
        "--row-floor",
        type=float,
        action="append",
        help="serve --row-floor for the speculative methods (repeatable; default 0.95)",
    )
    args = parser.parse_args()
    runtime = open_runtime(load_registry().get(args.model), print)
    prompts = [p for suite in args.suites.split(",") for p in load_suite(suite)]
    warm = argparse.Namespace(**{**vars(args), "requests": args.batch, "n": 2})
    closed_loop(runtime, NONE, prompts, warm)  # calibration, grid, kernels: not timed
    base, plain_pace = None, None
    runs = [
        (method, floor)
        for method in args.methods.split(",")
        for floor in ([ROW_FLOOR] if method == NONE else args.row_floor or [ROW_FLOOR])
    ]
    for method, floor in runs:
        seconds, tokens, rounds, widths, pace, split = closed_loop(
            runtime, method, prompts, args, floor
        )
        rate = tokens / seconds
        base = base or rate
        label = method if method == NONE else f"{method} (row floor {floor:g})"
        print(
            f"{label:30s} {tokens} tokens in {seconds:6.1f} s: {rate:6.2f} tok/s "
            f"({rate / base:.2f}x the first), {rounds} rounds, "
            f"widths {dict(sorted(widths.items()))}",
            flush=True,
        )
        paces = pace.versus_plain()
        if method == NONE:
            plain_pace = paces
        relative = {k: v / plain_pace[k] for k, v in paces.items()} if plain_pace else paces
        by_class = ", ".join(f"{k} {v:.2f}x" for k, v in relative.items())
        unit = "batched plain" if plain_pace else "plain passes"
        print(f"{'':30s} pace per class vs {unit}: {by_class}", flush=True)
        print(f"{'':30s} {split.line()}", flush=True)


if __name__ == "__main__":
    main()
