"""The verify-cost curve: what a verify of m tokens costs in plain target steps, measured
on the running machine (`calibrate`) within a time budget, and kept per model, weights and
machine in the cache dir. `verify(m)` is the whole story of what a draft can gain: on MLX's
CPU backend with OpenBLAS 8 tokens cost ~1.6 steps, with the reference BLAS ~7, and on a
GPU backend a width's first pass also compiles its kernels.

A curve is measured at a context length (`VerifyCost.context`), and the ratio moves with
it: attention over the cached tokens is work a wide pass does per new token, and a step
does once. Measured on SmolLM2 here (benchmarks/verify_context.py, docs/memory.md):
verify(16) 2.3 steps behind 500 tokens, about 4 behind 4,000. So a second curve is measured
at LONG_CONTEXT, lazily (the first prompt of LONG_PRICED_FROM tokens or more), on a
cache filled with zero KV rather than a prefill (4k tokens of prefill is minutes on
a CPU; a pass's cost does not depend on what the cache holds), and kept under its own key
(`calibration_key`'s `context`). A round is priced between the two (`at_context`).
"""

from __future__ import annotations

import bisect
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlxspec import device
from mlxspec.models.kv_form import FLOAT, KVForm
from mlxspec.paths import cache_dir, file_lock

CALIBRATION_SIZES = (1, 2, 3, 4, 8, 16, 32, 64)
# The order sizes are first timed in: the widths a policy drafts at first (a few tokens)
# before the wide ones it rarely reaches, so that a budget that runs out leaves them known.
MEASURE_ORDER = (1, 2, 4, 8, 3, 16, 32, 64)
# The most a calibration may take (seconds): it runs before a first speculative answer.
# Where wide passes are slow (quantized weights on MLX's CPU backend: 110 s for the
# unbounded calibration) it ends early; the widths it did not time are priced as dear as
# proportional, and the passes the engine runs correct the curve (Policy.observe_verify).
CALIBRATION_BUDGET_S = 2.0
PARTIAL_REMEASURES = 2  # later runs that measure a partial curve again (see measure_again)
ALWAYS_TIMED = (1, 2)  # timed once even past the budget: a step and a one-token draft
# The second curve's context, and the prompt length from which a request asks for it
# (below, a round is priced within a quarter of the way to the long curve anyway).
LONG_CONTEXT = 4096
LONG_PRICED_FROM = 1024
# In the cache key: calibrations made before the method changed are measured again.
CALIBRATION_METHOD = "interleaved-min"


@dataclass
class VerifyCost:
    """verify(m) / verify(1), interpolated from measured points; step_seconds = verify(1).

    `partial`: a time budget ended the measurement before every size was timed; past the
    widest timed size a verify is then priced proportionally (m / b times the cost at b,
    the most a compute-bound pass can grow), not by the last slope."""

    points: dict[int, float]
    step_seconds: float
    partial: bool = False
    measurements: int = 1  # calibrations merged into it (a partial one is measured again)
    context: int = 0  # tokens in the cache it was measured on (0: a few; entries before)

    def __call__(self, m: int) -> float:
        sizes = self.sizes
        if m >= sizes[-1] and self.partial:
            return self.points[sizes[-1]] * m / sizes[-1]
        if m <= sizes[0] or len(sizes) == 1:  # one point: no slope, a flat cost
            return self.points[sizes[0]]
        if m >= sizes[-1]:  # extrapolate with the last slope
            a, b = sizes[-2], sizes[-1]
            slope = (self.points[b] - self.points[a]) / (b - a)
            return self.points[b] + slope * (m - b)
        i = bisect.bisect_left(sizes, m)
        a, b = sizes[i - 1], sizes[i]
        return self.points[a] + (self.points[b] - self.points[a]) * (m - a) / (b - a)

    @cached_property
    def sizes(self) -> list[int]:
        """The measured sizes in order, sorted once: a batch's width choice prices
        hundreds of widths a round (a curve's points are never changed in place)."""
        return sorted(self.points)

    @cached_property
    def monotone(self) -> bool:
        """Whether no verify costs less than a shorter one (every measured curve: they are
        fitted so), which lets a search over k stop early (`Policy._plan`)."""
        prices = [self.points[m] for m in self.sizes]
        return all(a <= b for a, b in zip(prices, prices[1:]))

    def to_json(self) -> str:
        return json.dumps(
            {
                "points": self.points,
                "step_seconds": self.step_seconds,
                "partial": self.partial,
                "measurements": self.measurements,
                "context": self.context,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> VerifyCost:
        data = json.loads(text)
        points = {int(m): float(c) for m, c in data["points"].items()}
        partial, measurements = bool(data.get("partial", False)), int(data.get("measurements", 1))
        return cls(points, data["step_seconds"], partial, measurements, int(data.get("context", 0)))

    def merged(self, later: VerifyCost) -> VerifyCost:
        """This curve and a later calibration's: each width at the cheaper of its two
        prices (a cold or busy timing loses to a warm one), made monotone again; partial
        only if both were."""
        points = dict(later.points)
        for m, price in self.points.items():
            points[m] = min(price, points.get(m, price))
        sizes = sorted(points)
        fitted = running_max([points[m] for m in sizes])
        return VerifyCost(
            dict(zip(sizes, fitted)),
            later.step_seconds,
            self.partial and later.partial,
            self.measurements + later.measurements,
            later.context,
        )

    def seconds(self, m: int) -> float:
        """A verify of m tokens in seconds, at this curve's context."""
        return self(m) * self.step_seconds


def at_context(short: VerifyCost, long: VerifyCost, context: int, m: int) -> float:
    """verify(m) / verify(1) at `context` tokens, from a curve measured at a short context
    and one at a long one (`seconds_at_context`). Interpolating the seconds, not the
    ratios, keeps the step's own growth with the context in the unit."""
    return max(
        seconds_at_context(short, long, context, m) / seconds_at_context(short, long, context, 1),
        1.0,
    )


def seconds_at_context(short: VerifyCost, long: VerifyCost, context: int, m: int) -> float:
    """A verify of m tokens in seconds at `context` tokens: taken as affine in the context
    (the weights' work, plus attention over the cached tokens, linear in them), so
    interpolated between the two curves and extrapolated past the long one. The long
    curve never prices a pass cheaper than the short one (a timing in a calmer moment
    would otherwise extrapolate to passes that shrink with the context)."""
    t = max(context - short.context, 0) / max(long.context - short.context, 1)
    near = short.seconds(m)
    return near + t * max(long.seconds(m) - near, 0.0)


def running_max(ratios: list[float]) -> list[float]:
    """Monotone costs by carrying the largest so far forward (one process: its timings
    are steady enough that a high point is real)."""
    out, floor = [], 1.0
    for ratio in ratios:
        floor = max(floor, ratio)
        out.append(floor)
    return out


def pooled_monotone(ratios: list[float]) -> list[float]:
    """The least-squares monotone fit (pool adjacent violators), floored at one step.

    For a sharded target: its step is dominated by dozens of all-reduces whose latency
    hardly depends on the token count, so one slow timing is noise. The running max
    carries such a point to every larger size (measured on 3 ranks: 1.12 steps for 2
    tokens, 2.61 for 3 and every size after), and the policy stopped drafting more than
    one token; pooling averages the outlier with its neighbours instead."""
    blocks: list[list[float]] = []  # [mean, count] of pooled runs
    for ratio in ratios:
        blocks.append([max(ratio, 1.0), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            mean, count = blocks.pop()
            total = blocks[-1][0] * blocks[-1][1] + mean * count
            blocks[-1][1] += count
            blocks[-1][0] = total / blocks[-1][1]
    return [mean for mean, count in blocks for _ in range(int(count))]


def calibrate(
    forward: Callable[[int], None],
    reset: Callable[[], None],
    repeats: int = 5,
    clock: Callable[[], float] = time.perf_counter,
    progress: Callable[[int, int, int], None] = lambda done, total, size: None,
    fit: Callable[[list[float]], list[float]] = running_max,
    budget: float | None = CALIBRATION_BUDGET_S,
    order: tuple[int, ...] = MEASURE_ORDER,
    prepare: Callable[[], None] = lambda: None,
) -> VerifyCost:
    """Time `forward(m)` (a verify of m tokens on a warm context) for each size in `order`.

    `reset()` rolls the context back between timings. After one untimed one-token pass
    (kernels), the sizes take turns in `order` (1 first), `repeats` + 1 rounds of all of
    them, and each keeps its fastest time: a burst of other work on the machine then
    slows one round of every size, not every timing of one size. (Timed size by size, one
    busy moment while the one-token step was timed made every verify look dear, and the
    cached result kept the head from drafting: 1.34 steps measured for 2 tokens where
    1.12 is true on this CPU.) A size's first timing is cold: it counts only where no
    later one was made, and then no dearer than proportional to the widest narrower
    size's (on MLX's CUDA backend a width's first pass compiles its kernels: an H100
    priced 8 tokens at 8140 steps from one such timing, and the cache kept it).

    `budget` (seconds, None: unbounded) bounds the whole measurement, `prepare()` (the
    context's prefill) and the warm-up included, since the user waits for all of it: a pass
    is skipped when what it is expected to take (its last timing, else the widest
    narrower size's scaled proportionally) would pass the budget. One timing of each of
    ALWAYS_TIMED runs whatever it costs: the step, and the narrowest draft's verify,
    without which a slow machine (a busy one: 0.5 s steps) would never draft at all.
    Ranks of a sharded target run unbounded: they must all run the same passes.

    `progress(done, total, size)` is told before each forward pass (it takes seconds on
    a slow machine) and once more with done == total at the end.
    """
    done, total = 0, 1 + len(order) * (repeats + 1)
    timings: dict[int, list[float]] = {}

    def fits(m: int) -> bool:
        if budget is None or m in ALWAYS_TIMED and m not in timings:
            return True
        return clock() - start + expected_seconds(warm_prices(timings), m) <= budget

    progress(done, total, 1)
    done += 1
    start = clock()
    prepare()
    forward(1)  # warm-up: kernels (the answer's own first pass would pay for them)
    reset()
    for _ in range(repeats + 1):
        timed_this_round = False
        for m in order:
            if not fits(m):
                continue
            progress(done, total, m)
            done += 1
            begin = clock()
            forward(m)
            timings.setdefault(m, []).append(clock() - begin)
            reset()
            timed_this_round = True
        if not timed_this_round:
            break
    seconds = warm_prices(timings)
    progress(total, total, max(seconds))
    step, sizes = seconds[1], sorted(seconds)
    # A verify never costs less than a step; `fit` makes the timed costs monotone.
    ratios = fit([seconds[m] / step for m in sizes])
    points = {m: round(ratio, 4) for m, ratio in zip(sizes, ratios)}
    return VerifyCost(points, step, partial=len(sizes) < len(order))


def warm_prices(timings: dict[int, list[float]]) -> dict[int, float]:
    """Each size's seconds from its timings: the fastest after its first (cold) one, or,
    timed once, that one at most proportional to the widest narrower size's. The step
    (1) follows an untimed warm-up, so all of its timings count."""
    prices: dict[int, float] = {}
    for m in sorted(timings):
        times = timings[m]
        if m == 1 or len(times) > 1:
            prices[m] = min(times if m == 1 else times[1:])
            continue
        narrower = max((n for n in prices if n < m), default=None)
        bound = prices[narrower] * m / narrower if narrower else float("inf")
        prices[m] = min(times[0], bound)
    return prices


def expected_seconds(seconds: dict[int, float], m: int) -> float:
    """What a pass of m tokens is expected to take from the timings so far: its own, else
    the widest narrower size's scaled to m (as dear as a compute-bound pass grows)."""
    if m in seconds:
        return seconds[m]
    narrower = max((size for size in seconds if size < m), default=min(seconds))
    return seconds[narrower] * m / narrower


def measure_verify_cost(
    model,
    vocab_size: int,
    context: int = 4,
    progress: Callable[[int, int, int], None] = lambda done, total, size: None,
    kv: KVForm = FLOAT,
    synthetic: bool = False,
    **how,
) -> VerifyCost:
    """Calibrate a model's verify cost on a context of `context` tokens; `how`:
    `calibrate`'s repeats, fit and budget. The default context is short: its prefill is a
    wide pass of its own, inside the budget, and the attention over a few dozen more
    tokens is noise beside the weights' matmuls. `synthetic`: the cache is filled with
    zero KV instead of prefilled (`fill_synthetic`: a long context at no prefill)."""
    from mlx_lm.models.cache import make_prompt_cache  # mlx-lm loads transformers: not at import

    cache = make_prompt_cache(model)
    replace(kv, start=0).convert(cache)  # the passes read the KV form the curve prices

    def prefill() -> None:  # in chunks: a long context's one-pass attention is gigabytes
        from mlxspec.models.target import PREFILL_CHUNK  # the engine's (imports mlx-lm)

        if synthetic:
            fill_synthetic(model, cache, context)
            return
        for start in range(0, context, PREFILL_CHUNK):
            end = min(start + PREFILL_CHUNK, context)
            mx.eval(model(mx.arange(start, end)[None] % vocab_size, cache=cache))

    def forward(m: int) -> None:
        mx.eval(model(mx.arange(m)[None] % vocab_size, cache=cache))

    def reset() -> None:  # by `offset`: a quantized layer's size() is 0 (mlx-lm's default)
        for c in cache:
            if c.is_trimmable():
                c.trim(getattr(c, "offset", c.size()) - context)

    cost = calibrate(forward, reset, progress=progress, prepare=prefill, **how)
    return replace(cost, context=context)


def fills_synthetically(model) -> bool:
    """Whether every layer of the model's cache is plain attention KV, which
    `fill_synthetic` can fill (not a sliding window's, nor a recurrent layer's state)."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    return all(type(layer) is KVCache for layer in make_prompt_cache(model))


def fill_synthetic(model, cache: list, context: int) -> None:
    """Fill every layer of `cache` (fresh, float or quantized KV) with `context` tokens of
    zero keys and values, shaped as one real token's (a pass on a scratch cache tells
    each layer's heads, dims and dtype): attention's dense work does not depend on the
    values, so it costs what it does behind a real context of that length, without the
    prefill. One write a layer (random values, in chunks, took 2-4 s of the budget for
    SmolLM2 at 4,096 tokens here)."""
    from mlx_lm.models.cache import make_prompt_cache

    probe = make_prompt_cache(model)
    mx.eval(model(mx.zeros((1, 1), mx.int32), cache=probe))
    for layer, shaped in zip(cache, probe):
        keys, values = shaped.keys, shaped.values
        layer.update_and_fetch(
            *(mx.zeros((*x.shape[:2], context, x.shape[-1]), x.dtype) for x in (keys, values))
        )
        mx.eval(layer.keys, layer.values)


def calibration_key(
    model: str, weights: str, setup: str = "", kv: KVForm = FLOAT, context: int = 0
) -> str:
    """Where a calibration is kept: per model and the form of its weights in memory
    (`weights.held_weights`: a quantized curve never prices float weights), the form of
    its KV (a pass reading quantized KV is another pass), machine, BLAS and mlx version,
    plus the `setup` it ran in (e.g. a sharded target's split) and, for a curve measured
    behind a long context, that context (0: the short calibration, its key unchanged)."""
    facts = device.describe()
    key = (
        f"{model}|{weights}|{facts['device']}|{facts['blas']}|mlx {facts['mlx']}"
        f"|{CALIBRATION_METHOD}" + ("|tf32" if facts["tf32"] else "")
    )
    if kv.quantized:  # (float keeps the key it always had: its curves stay valid)
        key += f"|{kv.key}"
    if context:
        key += f"|context {context}"
    return f"{key}|{setup}" if setup else key


def cached_verify_cost(
    key: str, measure: Callable[[], VerifyCost], load: Callable[[str], Any] = VerifyCost.from_json
) -> VerifyCost:
    """Calibrations are per model and machine; keep them in the cache dir across runs.
    (`load` reads another kind of calibration kept the same way, e.g. a batch's.)"""
    path = cache_dir() / "calibration.json"
    known = known_calibration(key, load)
    if known is not None and not measure_again(known):
        return known
    cost = measure()  # outside the lock: it takes seconds
    if known is not None:
        cost = known.merged(cost)
    try:  # re-read under the lock, so another process's new entry is not written over
        with file_lock(path.with_suffix(".lock")):
            known = _read_calibrations(path)
            known[key] = cost.to_json()
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(known, indent=1))
            tmp.replace(path)
    except OSError:
        pass  # a read-only cache only costs a re-calibration next time
    return cost


def measure_again(known: Any) -> bool:
    """A partial verify-cost curve (or a weight-form decision made on one) is measured
    again by the next PARTIAL_REMEASURES runs: the budget may have ended on a busy moment,
    or on a GPU backend's first passes, which compile their kernels (kept compiled for the
    next process)."""
    return bool(getattr(known, "partial", False)) and known.measurements <= PARTIAL_REMEASURES


def known_calibration(key: str, load: Callable[[str], Any] = VerifyCost.from_json) -> Any | None:
    """What `cached_verify_cost` keeps under `key`, or None: read without measuring."""
    try:
        return load(_read_calibrations(cache_dir() / "calibration.json")[key])
    except (KeyError, TypeError, ValueError):
        return None


def _read_calibrations(path: Path) -> dict[str, str]:
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}
