"""One verify width a round for the whole batch: speculation that pays for the batch.

Every row drafts with its own policy, but the pass is as wide as its widest row, so
each row's draft is paid by all of them. After drafting, the scheduler picks one width
W (0 .. the longest draft): row i verifies min(k_i, W) of its drafts (a truncated draft
is still a draft: lossless is untouched), and W maximises the batch's expected tokens
per unit time,

    sum_i expected_tokens(a_i, min(k_i, W)) / cost(B rows x (W + 1) columns).

W = 0 is a plain round for every row, so under load speculation turns itself off.

The cost of a pass is NOT measured over (rows, width) yet. It is modelled from the
model's single-row verify curve (`VerifyCost`, calibrated per machine): a pass of B rows
of w tokens costs what one row of B * w tokens costs. That is the weight-read-bound
picture (a pass is one matmul over every token in it); it ignores that attention is per
row (cheaper than one long row's) and the per-row Python work. The real pass times
correct the shape online (`PassCost.observe`), as the single-sequence policy corrects
its own curve.
"""

from __future__ import annotations

from collections.abc import Callable

from mlxspec.policy import VerifyCost, expected_tokens


def choose_width(
    rows: list[tuple[float, int]], floor: int, pass_cost: Callable[[int, int], float]
) -> int:
    """The width W (floor .. max draft) with the best expected tokens per cost.

    `rows` holds each row's (acceptance rate, drafted k); `pass_cost(rows, columns)` is
    a pass's cost; `floor` is the least W (rows whose k was fixed by the request).
    Ties go to the narrower pass.
    """
    widest = max((k for _, k in rows), default=0)
    best_width, best_speed = floor, -1.0
    for width in range(floor, max(widest, floor) + 1):
        tokens = sum(expected_tokens(rate, min(k, width)) for rate, k in rows)
        speed = tokens / pass_cost(len(rows), width + 1)
        if speed > best_speed * (1 + 1e-9):
            best_width, best_speed = width, speed
    return best_width


class PassCost:
    """A batched pass's cost in single-step units, from the single-row curve, with the
    cost of its extra columns corrected online by the passes actually run.

    A pass of w columns is compared with plain passes (one column) over the same rows,
    timed in the same run, so a machine that is uniformly busier than at calibration
    changes nothing; only the curve's shape is corrected. Each plain pass also relaxes
    the correction towards the calibrated curve, so a scale learned in a bad moment
    cannot keep speculation off for good.
    """

    def __init__(self, curve: VerifyCost, decay: float = 0.9, relax: float = 0.05):
        self.curve, self.decay, self.relax = curve, decay, relax
        self.extra_scale = 1.0  # observed / modelled cost of the columns beyond the first
        self.plain_seconds: dict[int, float] = {}  # recent plain-pass time per row count

    def __call__(self, rows: int, columns: int) -> float:
        plain = self.curve(rows)
        return plain + self.extra_scale * (self.curve(rows * columns) - plain)

    def observe(self, rows: int, columns: int, seconds: float) -> None:
        """Feed back what a pass over `rows` x `columns` really took."""
        if columns == 1:
            known = self.plain_seconds.get(rows)
            self.plain_seconds[rows] = (
                seconds if known is None else self.decay * known + (1 - self.decay) * seconds
            )
            self.extra_scale += self.relax * (1.0 - self.extra_scale)
            return
        plain = self.curve(rows)
        modelled_extra = self.curve(rows * columns) - plain
        if rows not in self.plain_seconds or modelled_extra <= 0.02:
            return
        observed_extra = (seconds / self.plain_seconds[rows] - 1.0) * plain
        ratio = min(max(observed_extra / modelled_extra, 0.25), 4.0)
        self.extra_scale = self.decay * self.extra_scale + (1 - self.decay) * ratio
