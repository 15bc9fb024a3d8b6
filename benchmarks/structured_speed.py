"""Constrained answers, speculative vs plain, on the structured bench suite: each request's
generation rate after its prefill (every token, the first round's included: a forced
tool call's skeleton often comes whole in that round, which `bench`'s decode rate leaves
out), methods alternated within each repeat so a noisy machine hits all alike.

    python benchmarks/structured_speed.py --model smollm2-135m --repeats 5

Prints per prompt the median rate of: plain decoding unconstrained (`none@free`), plain
constrained (`none`), and each proposer constrained; then the two ratios issue 50 asks for
(constrained plain / unconstrained plain; speculative constrained / constrained plain),
and checks every speculative answer equals constrained plain decoding's. Recorded
results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics

from mlxspec.bench.suites import load_suite
from mlxspec.events import Done
from mlxspec.registry.models_toml import load_registry
from mlxspec.registry.runtime import open_runtime
from mlxspec.settings import GenerationSettings


def rate(done: Done) -> float:
    """Tokens over the time from the end of the prefill to the last token."""
    record = done.record
    seconds = record.time_to_first_token - record.prefill_seconds + record.decode_seconds
    return record.completion_tokens / seconds if seconds > 0 else 0.0


def geomean(values: list[float]) -> float:
    return statistics.geometric_mean(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--proposers", default="prompt-lookup,suffix")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    runtime = open_runtime(load_registry().get(args.model), print)
    engine = runtime.engine
    proposers = [runtime.proposer(name) for name in args.proposers.split(",")]
    methods = [("none@free", "none", False), ("none", "none", True)]
    methods += [(name, name, True) for name in proposers]
    engine.verify_cost  # noqa: B018  (calibrated before any timed run)
    rates: dict[tuple[str, str], list[float]] = {}
    answers: dict[tuple[str, str], tuple[int, ...]] = {}
    prompts = [p for p in load_suite("structured") if p.grammar is not None]
    for repeat in range(args.repeats + 1):  # the first round of runs warms up, untimed
        for prompt in prompts:
            messages = [{"role": "user", "content": prompt.text}]
            for label, proposer, constrained in methods:
                engine.reset()
                settings = GenerationSettings(
                    max_tokens=args.max_tokens,
                    grammar=prompt.grammar if constrained else None,
                    history=False,
                )
                done = list(engine.stream(messages, settings, proposer))[-1]
                answers[prompt.id, label] = done.token_ids
                if repeat:
                    rates.setdefault((prompt.id, label), []).append(rate(done))
    labels = [label for label, _, _ in methods]
    print(f"{'prompt':<14}" + "".join(f"{label:>16}" for label in labels) + "   (tok/s)")
    for prompt in prompts:
        row = [statistics.median(rates[prompt.id, label]) for label in labels]
        print(f"{prompt.id:<14}" + "".join(f"{value:>16.1f}" for value in row))
    for prompt in prompts:
        for label in labels[2:]:
            same = answers[prompt.id, label] == answers[prompt.id, "none"]
            print(f"{prompt.id} {label}: {'equal to' if same else 'DIFFERS from'} plain")

    def ratio(top: str, bottom: str) -> float:
        return geomean(
            [
                statistics.median(rates[p.id, top]) / statistics.median(rates[p.id, bottom])
                for p in prompts
            ]
        )

    print(f"constrained plain / unconstrained plain: {ratio('none', 'none@free'):.2f}x")
    for label in labels[2:]:
        print(f"{label} constrained / constrained plain: {ratio(label, 'none'):.2f}x")


if __name__ == "__main__":
    main()
