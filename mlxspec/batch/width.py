"""One verify width a round for the whole batch: speculation that pays for the batch.

Every row drafts with its own policy, but the pass is as wide as its widest row, so
each row's draft is paid by all of them. After drafting, the scheduler picks one width
W (0 .. the longest draft): row i verifies min(k_i, W) of its drafts (a truncated draft
is still a draft: lossless is untouched), and W maximises the batch's expected tokens
per unit time,

    sum_i expected_tokens(a_i, min(k_i, W)) / cost(B rows x (W + 1) columns).

W = 0 is a plain round for every row, so under load speculation turns itself off.

The cost of a pass over (rows, columns) is measured once per model and machine
(`measure_pass_grid`: real batched passes through `BatchTarget`, rows 1-8 x columns
1-8 on a warm context, interleaved and best-of-three like the single-row calibration)
and interpolated between the measured points (`PassGrid`). Where no grid was measured
(an engine handed a fixed cost, as the tests do) it is modelled from the single-row
verify curve: a pass of B rows of w tokens costs what one row of B * w tokens costs,
the weight-read-bound picture, which ignores that attention is per row and the per-row
work. Either way the real pass times correct the shape online (`PassCost.observe`), as
the single-sequence policy corrects its own curve.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from mlxspec.batch.target import BatchTarget, Prefill
from mlxspec.events import ProgressNote
from mlxspec.policy import VerifyCost, cached_verify_cost, calibration_key, expected_tokens

GRID_ROWS = (1, 2, 4, 8)
GRID_COLUMNS = (1, 2, 4, 8)


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


@dataclass
class PassGrid:
    """Measured pass costs in units of a one-row, one-column pass: cells[(rows, columns)].
    Between points it interpolates linearly (columns first, then rows); beyond the last
    point it extends the last slope, as `VerifyCost` does."""

    cells: dict[tuple[int, int], float]
    # Per row count, its cost over columns: built once, since every round's width choice
    # asks for a cost per candidate width.
    _lines: dict[int, VerifyCost] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._lines = {
            r: VerifyCost({c: cost for (r2, c), cost in self.cells.items() if r2 == r}, 1.0)
            for r in sorted({r for r, _ in self.cells})
        }

    def __call__(self, rows: int, columns: int) -> float:
        by_rows = {r: line(columns) for r, line in self._lines.items()}
        return VerifyCost(by_rows, 1.0)(rows)

    def to_json(self) -> str:
        return json.dumps({f"{r}x{c}": cost for (r, c), cost in self.cells.items()})

    @classmethod
    def from_json(cls, text: str) -> PassGrid:
        pairs = json.loads(text).items()
        return cls({tuple(map(int, key.split("x"))): float(cost) for key, cost in pairs})


def measure_pass_grid(
    model: nn.Module,
    vocab_size: int,
    context: int = 64,
    repeats: int = 3,
    clock: Callable[[], float] = time.perf_counter,
) -> PassGrid:
    """Time real batched verifies (`BatchTarget`) of each (rows, columns) of the grid on
    a warm context of `context` tokens a row. Cells take turns and keep their fastest
    time, so a busy moment slows one turn of every cell, not every timing of one."""
    targets = {}
    for rows in GRID_ROWS:
        target = BatchTarget(model)
        for row in range(rows):
            prefill = Prefill(model, [(row * 7 + i) % vocab_size for i in range(context)])
            prefill.advance(context)
            target.join(prefill)
        targets[rows] = target

    def forward(rows: int, columns: int) -> float:
        target = targets[rows]
        line = [i % vocab_size for i in range(columns)]
        start = clock()
        mx.eval(target.verify([line] * rows))
        seconds = clock() - start
        target.keep([0] * rows, columns)  # back to the warm context
        return seconds

    cells = [(r, c) for r in GRID_ROWS for c in GRID_COLUMNS]
    for rows, columns in cells:  # warm-up: kernels, buffer growth
        forward(rows, columns)
    best = {cell: float("inf") for cell in cells}
    for _ in range(repeats):
        for cell in cells:
            best[cell] = min(best[cell], forward(*cell))
    # More rows or more columns never cost less: a cell below a smaller one is noise
    # (as in the single-row calibration), so each cell is at least its neighbours below.
    unit, cells_out = best[(1, 1)], {}
    for rows in GRID_ROWS:
        for columns in GRID_COLUMNS:
            below = [cells_out.get((rows, c), 1.0) for c in GRID_COLUMNS if c < columns]
            below += [cells_out.get((r, columns), 1.0) for r in GRID_ROWS if r < rows]
            cost = max([best[(rows, columns)] / unit, 1.0, *below])
            cells_out[(rows, columns)] = round(cost, 4)
    return PassGrid(cells_out)


def pass_grid_for(engine) -> PassGrid | None:
    """The engine's measured pass grid (once per model and machine, then cached), or None
    where the engine was handed its costs."""
    if not engine.measures_costs:
        return None

    def measure() -> PassGrid:
        engine.notify(ProgressNote("measuring batched pass costs on this machine (once)", 0, 1))
        grid = measure_pass_grid(engine.target.model, engine.vocab_size)
        engine.notify(ProgressNote("measured batched pass costs", 1, 1))
        return grid

    key = calibration_key(engine.name, "batch pass grid")
    return cached_verify_cost(key, measure, load=PassGrid.from_json)


class PassCost:
    """A batched pass's cost in single-step units, from the single-row curve, with the
    cost of its extra columns corrected online by the passes actually run.

    A pass of w columns is compared with plain passes (one column) over the same rows,
    timed in the same run, so a machine that is uniformly busier than at calibration
    changes nothing; only the curve's shape is corrected. Each plain pass also relaxes
    the correction towards the calibrated curve, so a scale learned in a bad moment
    cannot keep speculation off for good.
    """

    def __init__(
        self,
        curve: VerifyCost,
        decay: float = 0.9,
        relax: float = 0.05,
        grid: PassGrid | None = None,
    ):
        self.curve, self.decay, self.relax, self.grid = curve, decay, relax, grid
        self.extra_scale = 1.0  # observed / modelled cost of the columns beyond the first
        self.plain_seconds: dict[int, float] = {}  # recent plain-pass time per row count

    def modelled(self, rows: int, columns: int) -> float:
        """The cost before online correction: measured grid, else the single-row curve."""
        if self.grid is not None:
            return self.grid(rows, columns)
        return self.curve(rows * columns)

    def __call__(self, rows: int, columns: int) -> float:
        plain = self.modelled(rows, 1)
        return plain + self.extra_scale * (self.modelled(rows, columns) - plain)

    def observe(self, rows: int, columns: int, seconds: float) -> None:
        """Feed back what a pass over `rows` x `columns` really took."""
        if columns == 1:
            known = self.plain_seconds.get(rows)
            self.plain_seconds[rows] = (
                seconds if known is None else self.decay * known + (1 - self.decay) * seconds
            )
            self.extra_scale += self.relax * (1.0 - self.extra_scale)
            return
        plain = self.modelled(rows, 1)
        modelled_extra = self.modelled(rows, columns) - plain
        if rows not in self.plain_seconds or modelled_extra <= 0.02:
            return
        observed_extra = (seconds / self.plain_seconds[rows] - 1.0) * plain
        ratio = min(max(observed_extra / modelled_extra, 0.25), 4.0)
        self.extra_scale = self.decay * self.extra_scale + (1 - self.decay) * ratio
