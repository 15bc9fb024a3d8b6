"""A proposer of known acceptance, for measuring the engine apart from any drafter.

It drafts the target's own next tokens, read from a plain greedy run of the same prompt
(`transcript`: prompt + that output), and replaces each drafted token by another with
probability 1 - A. Under greedy decoding each draft position is then kept with
probability A given the ones before it were: the per-token acceptance the policy
models. The engine's speed at a known A, beside what its verify-cost curve predicts
for that A (mlxspec/bench/synthetic.py), shows the engine's own overhead as their gap
on any machine. llama.cpp's speculative bench has the same idea.
"""

from __future__ import annotations

import numpy as np

from mlxspec.proposers.base import Draft, ProposalContext, Situation


class SyntheticAcceptance:
    needs_hidden = False
    cost_hint = 0.0

    def __init__(
        self,
        transcript: list[int],
        acceptance: float,
        vocab_size: int,
        seed: int = 0,
        name: str = "synthetic",
        k_max: int = 16,
    ):
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"acceptance must be in 0..1, got {acceptance}")
        self.name, self.k_max = name, k_max
        self.transcript, self.acceptance = list(transcript), acceptance
        self.vocab_size = vocab_size
        self.rng = np.random.default_rng(seed)
        # What was offered, per token: kept-position trials and successes up to the first
        # corrupted one (what greedy verification accepts when the output is the plain one).
        self.offered_trials = 0
        self.offered_kept = 0

    def situation(self, ctx: ProposalContext) -> Situation | None:
        """A draft only where the sequence is still the plain run's and has a next token."""
        n = len(ctx.tokens)
        if n >= len(self.transcript) or self.transcript[:n] != ctx.tokens:
            return None
        return Situation(self, "synthetic", prior=self.acceptance)

    def propose(self, ctx: ProposalContext, k: int) -> Draft:
        start = len(ctx.tokens)
        tokens = self.transcript[start : start + k]
        corrupt = self.rng.random(len(tokens)) >= self.acceptance
        for j in np.flatnonzero(corrupt):
            # Any other token: shift by 1..V-1, so the replacement never equals the truth.
            shift = 1 + int(self.rng.integers(self.vocab_size - 1))
            tokens[j] = (tokens[j] + shift) % self.vocab_size
        first_bad = int(np.argmax(corrupt)) if corrupt.any() else len(tokens)
        self.offered_kept += first_bad
        self.offered_trials += first_bad + (1 if first_bad < len(tokens) else 0)
        return Draft(tokens)
