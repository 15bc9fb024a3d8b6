"""The verify-cost curve at several context lengths: what a pass of m tokens costs, in
one-token steps at the same context, behind 500, 4k and 8k tokens (SmolLM2's context).

    python benchmarks/verify_context.py --context 500 4000 8000

Each context is calibrated as the engine calibrates (`measure_verify_cost`: the sizes take
turns, the fastest timing each) with no time budget, on a context of synthetic tokens
prefilled in chunks, and with `--synthetic` also on the engine's long-context form: the
cache filled with random KV, no prefill (`fill_synthetic`), to see that the two agree.
`--budget` prices the synthetic one as the engine does (CALIBRATION_BUDGET_S).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import mlxspec  # noqa: F401  (preloads OpenBLAS before mlx.core on Linux)

# isort: split
from mlxspec.decoding.verify_cost import measure_verify_cost
from mlxspec.models.kv_form import kv_form
from mlxspec.models.loading import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--context", type=int, nargs="+", default=[500, 4000, 8000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--synthetic", action="store_true", help="also on random KV")
    parser.add_argument("--prefilled", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--budget", type=float, default=None, help="seconds (default: none)")
    parser.add_argument("--kv-bits", type=int, default=None)
    args = parser.parse_args()
    loaded = load_model(args.model, progress=False)
    vocab = len(loaded.tokenizer.get_vocab())
    kv = kv_form(args.kv_bits)
    curves = {}
    kinds = [
        kind for kind, on in (("prefilled", args.prefilled), ("synthetic", args.synthetic)) if on
    ]
    for context in args.context:
        for kind in kinds:
            start = time.perf_counter()
            cost = measure_verify_cost(
                loaded.model,
                vocab,
                context=context,
                kv=kv,
                synthetic=kind == "synthetic",
                budget=args.budget,
                repeats=args.repeats,
            )
            curves[context, kind] = cost
            seconds = round(time.perf_counter() - start, 1)
            row = {"context": context, "kind": kind, "kv": kv.key, "seconds": seconds}
            print(json.dumps({**row, "step_s": cost.step_seconds, **cost.points}), file=sys.stderr)
    sizes = sorted({m for cost in curves.values() for m in cost.points})
    print(
        f"| context ({kv.key} KV) | cache | step ms | "
        + " | ".join(f"verify({m})" for m in sizes)
        + " |"
    )
    print("|---" * (len(sizes) + 3) + "|")
    for (context, kind), cost in curves.items():
        cells = " | ".join(f"{cost.points[m]:.2f}" if m in cost.points else "-" for m in sizes)
        print(f"| {context} | {kind} | {cost.step_seconds * 1000:.1f} | {cells} |")


if __name__ == "__main__":
    main()
