"""Suffix decoding's work a round as the request's context grows: milliseconds per round
of `situation` + `propose`, behind 1k to 128k tokens of synthetic text with a common
2-token match every 20 tokens (as code's indents are), best of three runs of 50 rounds.

    python benchmarks/suffix_context.py --context 1000 8000 32000 128000
"""

from __future__ import annotations

import argparse
import random
import time

from mlxspec.proposers.base import ProposalContext
from mlxspec.proposers.suffix import SuffixProposer


def round_ms(context: int, rounds: int = 50, runs: int = 3) -> float:
    rng = random.Random(0)
    tokens = [rng.randrange(2_000) for _ in range(context)]
    for start in range(0, context, 20):
        tokens[start : start + 2] = [7, 8]
    proposer = SuffixProposer(store=None)
    proposer.situation(ProposalContext(tokens, None, None, None, None, history=False))
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        for step in range(rounds):
            tokens += [5_000 + step, 7, 8] if step % 2 else [3]
            ctx = ProposalContext(tokens, None, None, None, None, history=False)
            if proposer.situation(ctx):
                proposer.propose(ctx, 8)
        best = min(best, (time.perf_counter() - start) / rounds * 1000)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, nargs="+", default=[1000, 8000, 32000, 128000])
    args = parser.parse_args()
    print("| context tokens | ms a round |")
    print("|---|---|")
    for context in args.context:
        print(f"| {context} | {round_ms(context):.3f} |")


if __name__ == "__main__":
    main()
