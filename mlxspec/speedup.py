"""Speedup over plain decoding, priced with times from each round alone: load-invariant.

A live tokens/s divided by a plain rate measured at another moment compares two
different loads (the chat once showed 0.64x mid-answer where the bench measured 1.5x on
the same prompt). Here each round is priced in plain target steps with times from that
round only: its verify of m tokens took `verify_seconds` and costs c(m) steps by this
machine's verify-cost curve (as the policy corrects it online), so one step takes
verify_seconds / c(m) right now, and the whole round (drafting, verifying, accepting,
bookkeeping) costs round_seconds * c(m) / verify_seconds steps. Plain decoding makes
one token per step, so the speedup is tokens made over steps spent. A busy machine
slows a round's parts alike and leaves the ratio alone.

`generate --json` (the run record), the chat's status bar and `mlxspec bench` all
show this figure, from the same code.
"""

from __future__ import annotations

from dataclasses import dataclass


def round_steps(round_seconds: float, verify_seconds: float, verify_cost: float) -> float:
    """What one round cost in plain target steps; `verify_cost` is c(m), the round's
    verify relative to a one-token step."""
    if verify_seconds <= 0:
        return verify_cost
    return verify_cost * max(round_seconds, verify_seconds) / verify_seconds


@dataclass
class SpeedupEstimate:
    """Tokens made and plain steps spent, summed over rounds."""

    tokens: int = 0
    steps: float = 0.0

    def add_round(self, tokens: int, steps: float) -> None:
        self.tokens += tokens
        self.steps += steps

    @property
    def value(self) -> float:
        """Tokens per plain step: 1.0 is as fast as plain decoding (0.0 before any round)."""
        return self.tokens / self.steps if self.steps > 0 else 0.0
