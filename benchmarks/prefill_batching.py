"""Joining prompts' prefill: one by one (what the scheduler does) or in one pass?

    python benchmarks/prefill_batching.py --sizes 2 4 8 --trials 2

Takes random groups of the shipped suites' chat prompts and prefills each group twice,
best of `--repeats`: one prompt after another, each in its own cache (`Prefill`, as a
joining request is fed), and all in one right-padded pass over a batch cache, as
mlx-lm's `PromptProcessingBatch.prompt` does (`prepare(lengths, right_padding)`, one
forward, `finalize`). Prints tokens/s of both and their ratio per group, and the same
for the group's shortest prompts, where a batched pass has the most to win: a short
prompt alone runs its matmuls far below the machine's rate.

A padded pass computes every row to the longest prompt, so on a compute-bound machine
(this CPU) it wins only when the prompts are short and alike; on a weight-bound one
the balance differs. Compare the ratios, not the absolute rates, across machines.
"""

from __future__ import annotations

import argparse
import random
import time

import mlxspec  # noqa: F401  (preloads OpenBLAS before mlx.core on Linux)

# isort: split
import mlx.core as mx
from mlx_lm.generate import _merge_caches
from mlx_lm.models.cache import make_prompt_cache

from mlxspec.bench.suites import load_suite
from mlxspec.registry.models_toml import load_registry
from mlxspec.registry.runtime import open_runtime


def one_by_one(model, group: list[list[int]]) -> None:
    for tokens in group:
        cache = make_prompt_cache(model)
        model(mx.array([tokens]), cache=cache)
        mx.eval([c.state for c in cache])


def in_one_pass(model, group: list[list[int]]) -> None:
    cache = _merge_caches([make_prompt_cache(model) for _ in group])
    lengths = [len(t) for t in group]
    longest = max(lengths)
    for c in cache:
        c.prepare(lengths=lengths, right_padding=[longest - n for n in lengths])
    model(mx.array([t + [0] * (longest - len(t)) for t in group]), cache=cache)
    for c in cache:
        c.finalize()
    mx.eval([c.state for c in cache])


def best_of(run, model, group, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run(model, group)
        best = min(best, time.perf_counter() - start)
    return best


def compare(model, name: str, group: list[list[int]], repeats: int) -> None:
    alone, together = (best_of(run, model, group, repeats) for run in (one_by_one, in_one_pass))
    tokens = sum(map(len, group))
    padded = len(group) * max(map(len, group))
    print(
        f"{name:>14}: {len(group)} prompts, {tokens} tokens ({padded} padded): "
        f"one by one {tokens / alone:5.0f} tok/s, one pass {tokens / together:5.0f} tok/s, "
        f"ratio {alone / together:.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="models.toml entry (default: default)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--trials", type=int, default=2, help="random groups per size")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    runtime = open_runtime(load_registry().get(args.model), print)
    engine = runtime.engine
    model = engine.target.model
    prompts = [
        engine.encode_chat([{"role": "user", "content": p.text}])[:-1] for p in load_suite("all")
    ]
    print("prompt lengths:", sorted(map(len, prompts)))
    rng = random.Random(0)
    one_by_one(model, prompts[:2])  # warm-up: kernels, buffers
    in_one_pass(model, prompts[:2])
    for size in args.sizes:
        for trial in range(args.trials):
            compare(model, f"random #{trial + 1}", rng.sample(prompts, size), args.repeats)
        compare(model, "shortest", sorted(prompts, key=len)[:size], args.repeats)


if __name__ == "__main__":
    main()
