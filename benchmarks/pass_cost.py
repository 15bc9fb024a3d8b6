"""What one batched target pass costs, by rows, columns and context: the ceiling on what
batching can give a machine, before any scheduling.

    python benchmarks/pass_cost.py --model smollm2-135m --context 64 512

Each cell is the median of `--repeats` passes over B rows of W new tokens each, on top
of a left-padding-free `BatchKVCache` already holding `context` tokens per row (the cache
is trimmed back after every pass), printed in ms and as a multiple of one row's one-token
step at the same context. Aggregate decode speed of B plain rows is B / (that multiple)
times one row's; prefill is not in it (it is compute-bound and shares nothing).
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlxspec  # noqa: F401  (preloads OpenBLAS before mlx.core on Linux)

# isort: split
import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from mlxspec.models.loading import load_model

SHAPES = ((1, 1), (2, 1), (4, 1), (8, 1), (8, 2), (8, 4), (16, 1), (1, 8))


def pass_seconds(model, rows: int, columns: int, context: int, repeats: int) -> float:
    cache = [BatchKVCache([0] * rows) for _ in model.layers]
    mx.eval(model(mx.full((rows, context), 100, dtype=mx.int32), cache=cache))
    new = mx.full((rows, columns), 5, dtype=mx.int32)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(model(new, cache=cache))
        times.append(time.perf_counter() - start)
        for layer in cache:
            layer.trim(columns)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--context", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    model = load_model(args.model).model
    print("| context | rows x columns | ms | x one row's step |")
    print("|---|---|---|---|")
    for context in args.context:
        single = pass_seconds(model, 1, 1, context, args.repeats)
        for rows, columns in SHAPES:
            if (rows, columns) == (1, 1):
                seconds = single
            else:
                seconds = pass_seconds(model, rows, columns, context, args.repeats)
            ratio = seconds / single
            print(f"| {context} | {rows} x {columns} | {seconds * 1000:.0f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
