"""A draft model's price, measured on the running machine beside its target: its step in
target steps (the two steps timed in turns, so that a busy moment slows both alike), and
the curve of its own passes, which prices a catch-up after it was off. A guess from the
bytes each step reads (what came before) is wrong where a step is bound by something else:
a small model's kernel launches, a quantized model's unpacking on a CPU.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from mlxspec.decoding.verify_cost import (
    CALIBRATION_BUDGET_S,
    VerifyCost,
    cached_verify_cost,
    calibration_key,
    measure_verify_cost,
)

PAIR_REPEATS = 8  # rounds of (target step, draft step); each keeps its fastest
PAIR_AT_LEAST = 2  # rounds timed whatever the budget: the first may be cold


@dataclass
class DraftCost:
    """`step_ratio`: the draft's step over the target's, both timed here in turns;
    `curve`: the draft's pass of n tokens in its own steps (`VerifyCost`)."""

    step_ratio: float
    curve: VerifyCost
    partial: bool = False
    measurements: int = 1

    def to_json(self) -> str:
        return json.dumps({"step_ratio": self.step_ratio, "curve": self.curve.to_json()})

    @classmethod
    def from_json(cls, text: str) -> DraftCost:
        data = json.loads(text)
        curve = VerifyCost.from_json(data["curve"])
        return cls(float(data["step_ratio"]), curve, curve.partial, curve.measurements)

    def merged(self, later: DraftCost) -> DraftCost:
        """A partial measurement measured again: the later ratio, the curves merged."""
        curve = self.curve.merged(later.curve)
        return DraftCost(later.step_ratio, curve, curve.partial, curve.measurements)


def step_ratio(
    target_step: Callable[[], None],
    draft_step: Callable[[], None],
    clock: Callable[[], float] = time.perf_counter,
    budget: float = CALIBRATION_BUDGET_S,
) -> float:
    """The draft's step over the target's: one untimed step each (kernels), then rounds of
    one of each, each keeping its fastest, until PAIR_REPEATS rounds or the budget."""
    target_step()
    draft_step()
    best_target = best_draft = float("inf")
    start = clock()
    for done in range(PAIR_REPEATS):
        if done >= PAIR_AT_LEAST and clock() - start > budget:
            break
        begin = clock()
        target_step()
        middle = clock()
        draft_step()
        end = clock()
        best_target, best_draft = min(best_target, middle - begin), min(best_draft, end - middle)
    return best_draft / best_target


def one_token_steps(model, vocab_size: int, context: int = 4) -> Callable[[], None]:
    """A one-token step of `model` on a short context, rolled back after each."""
    from mlx_lm.models.cache import make_prompt_cache  # mlx-lm loads transformers: not at import

    cache = make_prompt_cache(model)
    mx.eval(model(mx.arange(context)[None] % vocab_size, cache=cache))

    def step() -> None:
        mx.eval(model(mx.array([[1]]), cache=cache))
        for c in cache:
            if c.is_trimmable():
                c.trim(1)

    return step


def measure_draft_cost(draft, target, vocab_size: int) -> DraftCost:
    """The draft's step beside the target's, and its own passes' curve (each within the
    calibration's budget)."""
    ratio = step_ratio(one_token_steps(target, vocab_size), one_token_steps(draft, vocab_size))
    curve = measure_verify_cost(draft, vocab_size)
    return DraftCost(ratio, curve, curve.partial)


def cached_draft_cost(
    draft_name: str, target_name: str, weights: str, measure: Callable[[], DraftCost]
) -> DraftCost:
    """Kept with the verify-cost calibrations: per pair, the draft's weights in memory
    (`weights`), machine and mlx; a partial one is measured again by the next runs."""
    key = calibration_key(f"draft {draft_name}", weights, f"pair with {target_name}")
    return cached_verify_cost(key, measure, load=DraftCost.from_json)
