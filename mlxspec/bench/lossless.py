"""Greedy outputs must equal plain mlx-lm's; where one does not, say where and how close.

A batched verify never rounds exactly like a one-token step, so a divergence at a near
tie of the target's top two logits is float noise, and a divergence at a wide gap is a
bug. The bench reports the gap rather than judging: the reader sees which it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generate_step


@dataclass(frozen=True)
class Divergence:
    repeat: int
    position: int  # index of the first output token that differs
    plain_top2_gap: float  # plain decoding's best-minus-second logit there


def first_divergence(reference: list[int], got: list[int]) -> int | None:
    """Index of the first differing token (a length difference counts); None if equal."""
    if got == reference:
        return None
    common = min(len(got), len(reference))
    return next((i for i in range(common) if got[i] != reference[i]), common)


def plain_top2_gap(model: nn.Module, tokens: list[int]) -> float:
    """Top-2 logit gap of mlx-lm's plain step after `tokens` (log-probs keep logit gaps)."""
    _, logprobs = next(generate_step(mx.array(tokens), model, max_tokens=1))
    second, best = mx.sort(logprobs)[-2:].tolist()
    return best - second
