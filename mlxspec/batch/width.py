"""One verify width a round for the whole batch: speculation that pays for the batch.

Every row drafts with its own policy, but the pass is as wide as its widest row, so
each row's draft is paid by all of them. After drafting, the scheduler picks one width
W (0 .. the longest draft): row i verifies min(k_i, W) of its drafts (a truncated draft
is still a draft: lossless is untouched), and W maximises the batch's expected tokens
per unit time,

    sum_i expected_tokens(a_i, min(k_i, W)) / cost(B rows x (W + 1) columns).

W = 0 is a plain round for every row, so under load speculation turns itself off.

That sum alone is unfair: rows that copy (an edit echoing its file) earn wide passes,
and rows of open text that draft little pay for every column. On a compute-bound CPU
the open rows of a mixed batch fell to 0.56x of batched plain while the copy-heavy ones
reached 1.51x. So a width is allowed only if every row still expects at least
`row_floor` (default 0.95) of the speed a plain pass would give it:

    expected_tokens(a_i, min(k_i, W)) / cost(B x (W + 1)) >= row_floor / cost(B x 1).

Where extra columns are nearly free (a weight-bound Mac, or a narrow pass here) the
floor binds nothing; where they are dear, a batch speculates as wide as its least
rewarded row can afford. `row_floor = 0` gives the plain sum (the batch's total first).

The cost of a pass over (rows, columns) is measured once per model and machine
(`measure_pass_grid`: real batched passes through `BatchTarget`, rows 1-8 x columns
1-16 on a warm context, interleaved and best-of-three like the single-row calibration)
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
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn

from mlxspec.batch.owner import RoundOwner
from mlxspec.batch.target import BatchTarget, Prefill
from mlxspec.decoding.policy import expected_tokens
from mlxspec.decoding.verify_cost import VerifyCost, cached_verify_cost, calibration_key
from mlxspec.events import ProgressNote

if TYPE_CHECKING:
    from mlxspec.batch.caches import BatchCaches
    from mlxspec.batch.single import SingleCaches

GRID_ROWS = (1, 2, 4, 8)
GRID_COLUMNS = (1, 2, 4, 8, 16)
GRID_BUDGET_S = 3.0  # seconds: a timing turn after the first starts only within them


# The least share of its plain-pass speed a row may expect from a round's width.
ROW_FLOOR = 0.95


def choose_width(
    rows: list[tuple[float, int]],
    floor: int,
    pass_cost: Callable[[int, int], float],
    row_floor: float = ROW_FLOOR,
) -> int:
    """The width W (floor .. max draft) with the best expected tokens per cost, among
    those that give every row at least `row_floor` of its plain speed.

    `rows` holds each row's (acceptance rate, drafted k); `pass_cost(rows, columns)` is
    a pass's cost; `floor` is the least W (rows whose k was fixed by the request), always
    allowed. Ties go to the narrower pass.
    """
    widest = max((k for _, k in rows), default=0)
    plain = pass_cost(len(rows), 1)
    best_width, best_speed = floor, -1.0
    for width in range(floor, max(widest, floor) + 1):
        cost = pass_cost(len(rows), width + 1)
        tokens = [expected_tokens(rate, min(k, width)) for rate, k in rows]
        if width > floor and min(tokens, default=1.0) * plain < row_floor * cost:
            continue  # a row would pay for the others' drafts beyond its floor
        speed = sum(tokens) / cost
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
    # Each (rows, columns) asked, interpolated once: the cells never change.
    _asked: dict[tuple[int, int], float] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._lines = {
            r: VerifyCost({c: cost for (r2, c), cost in self.cells.items() if r2 == r}, 1.0)
            for r in sorted({r for r, _ in self.cells})
        }
        self._asked = {}

    def __call__(self, rows: int, columns: int) -> float:
        cost = self._asked.get((rows, columns))
        if cost is None:
            by_rows = {r: line(columns) for r, line in self._lines.items()}
            cost = self._asked[(rows, columns)] = VerifyCost(by_rows, 1.0)(rows)
        return cost

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
    budget: float = GRID_BUDGET_S,
) -> PassGrid:
    """Time real batched verifies (`BatchTarget`) of each (rows, columns) of the grid on
    a warm context of `context` tokens a row. Cells take turns and keep their fastest
    time, so a busy moment slows one turn of every cell, not every timing of one. After
    an untimed turn (kernels: on a GPU backend each new shape compiles its own) and one
    timed turn, further turns run only while `budget` seconds of timing last."""
    targets = {}
    for rows in GRID_ROWS:
        target = BatchTarget(model)
        for row in range(rows):
            prefill = Prefill(model, [(row * 7 + i) % vocab_size for i in range(context)])
            prefill.advance(context)
            target.join([prefill])
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
    start = clock()
    for turn in range(repeats):
        if turn and clock() - start > budget:
            break
        for cell in cells:
            best[cell] = min(best[cell], forward(*cell))
    return PassGrid(monotone_cells(best))


def monotone_cells(seconds: dict[tuple[int, int], float]) -> dict[tuple[int, int], float]:
    """Timed cells as costs in one-row, one-column passes that never fall as rows or
    columns grow.

    Load only ever slows a timing, so a cell dearer than a larger pass is the noisy one:
    each cell takes the least time of itself and every pass at least as large. (Lifting
    each cell to its smaller neighbours instead carried one slow timing to every larger
    cell: a grid measured under load read 3.16 for 2 rows x 1 column and 4.04 for every
    pass from 2 x 2 to 8 x 4, so wide drafts looked free and one column dear, and the
    batch drafted either nothing or 15-27 tokens a row.)
    """
    least = {
        (rows, columns): min(t for (r, c), t in seconds.items() if r >= rows and c >= columns)
        for rows, columns in seconds
    }
    unit = least[min(least)]
    return {cell: round(max(t / unit, 1.0), 4) for cell, t in sorted(least.items())}


def pass_grid_for(engine: RoundOwner) -> PassGrid | None:
    """The engine's measured pass grid (once per model and machine, then cached), or None
    where the engine was handed its costs."""
    if not engine.measures_costs:
        return None

    def measure() -> PassGrid:
        engine.notify(ProgressNote("measuring batched pass costs on this machine (once)", 0, 1))
        grid = measure_pass_grid(engine.target.model, engine.vocab_size)
        engine.notify(ProgressNote("measured batched pass costs", 1, 1))
        return grid

    key = calibration_key(
        engine.name, engine.weights["held"], "batch pass grid v2"
    )  # v1 grids lifted outliers
    return cached_verify_cost(key, measure, load=PassGrid.from_json)


class PassCost:
    """A batched pass's cost in single-step units: measured (grid, else the single-row
    curve), with the cost of its extra columns corrected online by the passes actually
    run.

    A pass of w columns is compared with plain passes (one column) over the same rows,
    timed in the same run, so a machine that is uniformly busier than at calibration
    changes nothing; only the shape is corrected. Each (rows, columns) the batch has run
    keeps its own observed cost; a pass not run yet scales the modelled extra columns by
    what the run ones showed, and costs at least the nearest narrower pass run with its
    cost per column carried on.
    A pass's learned cost is forgotten once `explore_every` passes went by without it,
    so a cost learned in a bad moment cannot keep speculation off for good (the model
    prices that pass again, and the batch tries it once more if the model says it
    pays: exploration at most once per `explore_every` passes). The other way round, a
    batch that has not run a plain pass over its rows for `explore_every` passes runs
    one (`wants_plain`), so a plain pass timed in a bad moment cannot keep it
    speculating at a loss for good. Load only ever slows a pass: a plain pass faster
    than the one remembered replaces it at once, a slower one moves it by the decay,
    and no pass is learned as cheaper than a plain one over the same rows.

    (One global scale alone could not learn from a model that priced extra columns at
    nothing: a grid timed while the machine was quiet read 8 rows x 2 columns as cheap
    as 8 x 1; under load it cost 1.65x, and the batch drafted at a loss, 0.70x plain.)
    """

    def __init__(
        self,
        curve: VerifyCost,
        decay: float = 0.9,
        relax: float = 0.05,
        grid: PassGrid | None = None,
        explore_every: int = 32,
    ):
        self.curve, self.decay, self.relax, self.grid = curve, decay, relax, grid
        self.explore_every = explore_every
        self.extra_scale = 1.0  # observed / modelled cost of the columns beyond the first
        self.plain_seconds: dict[int, float] = {}  # recent plain-pass time per row count
        self.seen: dict[tuple[int, int], float] = {}  # observed cost / plain, per pass
        self.seen_at: dict[tuple[int, int], int] = {}  # the pass that last observed it
        self.passes = 0  # passes observed
        self.since_plain: dict[int, int] = {}  # wide passes since the last plain one

    def wants_plain(self, rows: int) -> bool:
        """Whether the next pass over `rows` rows should be plain, to time it: none over
        as many rows was timed yet (a wide pass is only learned against one), or the
        last was `explore_every` wide passes ago. (Without the first rule a batch whose
        grid priced 8 x 2 as free ran 32 wide passes at 1.8x a plain one, learning
        nothing, before its first plain pass over 8 rows.)"""
        if rows not in self.plain_seconds:
            return True
        return self.since_plain.get(rows, 0) >= self.explore_every

    def modelled(self, rows: int, columns: int) -> float:
        """The cost before online correction: measured grid, else the single-row curve."""
        if self.grid is not None:
            return self.grid(rows, columns)
        return self.curve(rows * columns)

    def __call__(self, rows: int, columns: int) -> float:
        plain = self.modelled(rows, 1)
        if columns == 1:
            return plain
        if (rows, columns) in self.seen:
            return plain * self.seen[(rows, columns)]
        scaled = plain + self.extra_scale * (self.modelled(rows, columns) - plain)
        narrower = [(c, ratio) for (r, c), ratio in self.seen.items() if r == rows and c < columns]
        if not narrower:
            return scaled
        # The nearest narrower pass run, its cost per extra column carried on: linear,
        # which a weight-bound machine beats (so the width grows one pass at a time).
        seen_columns, ratio = max(narrower)
        per_column = (ratio - 1.0) / (seen_columns - 1) if seen_columns > 1 else 0.0
        return max(scaled, plain * (ratio + (columns - seen_columns) * per_column))

    def observe(self, rows: int, columns: int, seconds: float) -> None:
        """Feed back what a pass over `rows` x `columns` really took."""
        if columns == 1:
            known = self.plain_seconds.get(rows)
            self.plain_seconds[rows] = (
                seconds
                if known is None or seconds < known
                else self.decay * known + (1 - self.decay) * seconds
            )
            self.since_plain[rows] = 0
            self._count_pass()
            self.extra_scale += self.relax * (1.0 - self.extra_scale)
            return
        self.since_plain[rows] = self.since_plain.get(rows, 0) + 1
        self._count_pass()
        if rows not in self.plain_seconds:
            return
        observed = max(seconds / self.plain_seconds[rows], 1.0)  # in plain passes, these rows
        known = self.seen.get((rows, columns))
        self.seen[(rows, columns)] = (
            observed if known is None else self.decay * known + (1 - self.decay) * observed
        )
        self.seen_at[(rows, columns)] = self.passes
        plain = self.modelled(rows, 1)
        modelled_extra = self.modelled(rows, columns) - plain
        if modelled_extra <= 0.02:
            return
        ratio = min(max((observed - 1.0) * plain / modelled_extra, 0.25), 4.0)
        self.extra_scale = self.decay * self.extra_scale + (1 - self.decay) * ratio

    def _count_pass(self) -> None:
        """One more pass observed: a cost no pass has observed for `explore_every`
        passes is forgotten."""
        self.passes += 1
        for cell in [c for c, at in self.seen_at.items() if at <= self.passes - self.explore_every]:
            del self.seen[cell], self.seen_at[cell]


def prefill_group(
    caches: BatchCaches | SingleCaches,
    request_ids: list[int],
    chunk: int,
    cost: Callable[[int, int], float] | None,
) -> list[int]:
    """Which joining prompts to feed in one left-padded pass this round (`feed_together`):
    of the fresh ones, the shortest that save the most by the pass cost the batch prices
    its rounds with (`PassCost`), against one pass each; none alone (`cost` None), or
    where the caches cannot. A padded pass computes every row to the longest, so where a pass
    costs its tokens (this CPU) only short, alike prompts gain (random groups of chat
    prompts ran 0.44-0.71x one by one, 2-4 short alike ones 1.35-1.48x:
    benchmarks/prefill_batching.py); where it costs its weights, all of them do."""
    if cost is None or len(request_ids) < 2 or not caches.target.feeds_together:
        return []
    fresh = [i for i in request_ids if caches.prefills[i].fresh and caches.unfed(i)]
    pieces = sorted((min(chunk, caches.unfed(i)), i) for i in fresh)
    best, saved, apart = [], 0.0, 0.0
    for n, (tokens, _) in enumerate(pieces, start=1):
        apart += cost(1, tokens)
        saving = apart - cost(n, tokens) if n > 1 else 0.0
        if saving > saved:
            best, saved = [i for _, i in pieces[:n]], saving
    return best
