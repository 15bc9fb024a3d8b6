"""Batched speculation against batched plain, engine only: B slots kept full from a queue.

    python benchmarks/batch_closed_loop.py --requests 32 -n 48 --methods none,prompt-lookup

The scheduler runs `--batch` slots; each finished request is replaced by the next one of
`--requests` (the shipped code, summarize and chat suites, cycled), as clients in a closed
loop would. Prints each method's tokens/s, verify rounds and the widths the batch chose.
The rounds matter beside the time: a batch runs as many rounds as its slowest slot
needs, so only a queue longer than the batch shows what speculation saves. No server, no
HTTP; `mlxspec bench --concurrency` measures through the API. Compare ratios within one
run: the methods run in turn in this process.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

import mlxspec  # noqa: F401  (OpenBLAS before mlx.core)
from mlxspec.batch.scheduler import Scheduler
from mlxspec.bench.suites import load_suite
from mlxspec.engine import GenerationSettings
from mlxspec.events import Accepted, Bonus, Corrected, Done
from mlxspec.registry import NONE, load_registry
from mlxspec.runtime import Runtime, open_runtime


def closed_loop(runtime: Runtime, method: str, prompts, args) -> tuple[float, int, int, Counter]:
    """Seconds, tokens, rounds and the round widths of one method's run."""
    proposer = runtime.proposer(method) if method != NONE else NONE
    scheduler = Scheduler(runtime.engine, max_batch=args.batch)
    queue = [prompts[i % len(prompts)] for i in range(args.requests)]
    settings = GenerationSettings(max_tokens=args.n)
    widths: Counter = Counter()
    truncate = scheduler._truncate

    def counted(rounds):
        cut = truncate(rounds)
        widths[max(len(r.tree) for r in cut)] += 1
        return cut

    scheduler._truncate = counted

    def submit() -> None:
        prompt = queue.pop(0)
        scheduler.submit([{"role": "user", "content": prompt.text}], settings, proposer)

    for _ in range(min(args.batch, len(queue))):
        submit()
    start, tokens, rounds = time.perf_counter(), 0, 0
    while scheduler.busy:
        out = scheduler.step()
        rounds += 1
        for events in out.values():
            made = [e for e in events if isinstance(e, Accepted | Bonus | Corrected)]
            tokens += sum(len(e.tokens) for e in made)
            if queue and any(isinstance(e, Done) for e in events):
                submit()
    return time.perf_counter() - start, tokens, rounds, widths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--suites", default="code,summarize,chat")
    parser.add_argument("-n", type=int, default=48, help="new tokens per request")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--methods", default="none,prompt-lookup")
    args = parser.parse_args()
    runtime = open_runtime(load_registry().get(args.model), print)
    prompts = [p for suite in args.suites.split(",") for p in load_suite(suite)]
    warm = argparse.Namespace(**{**vars(args), "requests": args.batch, "n": 2})
    closed_loop(runtime, NONE, prompts, warm)  # calibration, grid, kernels: not timed
    base = None
    for method in args.methods.split(","):
        seconds, tokens, rounds, widths = closed_loop(runtime, method, prompts, args)
        rate = tokens / seconds
        base = base or rate
        print(
            f"{method:16s} {tokens} tokens in {seconds:6.1f} s: {rate:6.2f} tok/s "
            f"({rate / base:.2f}x the first), {rounds} rounds, "
            f"widths {dict(sorted(widths.items()))}",
            flush=True,
        )


if __name__ == "__main__":
    main()
