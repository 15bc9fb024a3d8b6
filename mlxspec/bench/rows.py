"""From timed runs to table rows (one per prompt and method) and per-class summaries.

Speeds are medians over repeats, with the min-max spread beside them; the speedup of
a row is its median over plain-mlx-lm's median on the same prompt. Acceptance pools
the drafts of all repeats.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict
from typing import Any

from mlxspec.bench.methods import PLAIN
from mlxspec.bench.run import Run

ALL_CLASSES = "all"


def build_rows(runs: list[Run]) -> list[dict[str, Any]]:
    groups: dict[tuple[str, str], list[Run]] = {}
    for run in runs:
        groups.setdefault((run.prompt.id, run.method.name), []).append(run)
    plain_speed = {
        prompt: _median_speed(group)
        for (prompt, method), group in groups.items()
        if method == PLAIN
    }
    return [_row(group, plain_speed.get(prompt)) for (prompt, _), group in groups.items()]


def _speeds(group: list[Run]) -> list[float]:
    return [s for run in group if (s := run.measurement.tokens_per_second) is not None]


def _median_speed(group: list[Run]) -> float | None:
    speeds = _speeds(group)
    return statistics.median(speeds) if speeds else None


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator else None


def _row(group: list[Run], plain_speed: float | None) -> dict[str, Any]:
    first = group[0]
    measurements = [run.measurement for run in group]
    speeds, speed = _speeds(group), _median_speed(group)
    drafted = sum(m.drafted for m in measurements)
    accepted = sum(m.accepted for m in measurements)
    verify_steps = sum(m.verify_steps for m in measurements)
    divergence = next((run.divergence for run in group if run.divergence), None)
    return {
        "prompt": first.prompt.id,
        "class": first.prompt.kind,
        "method": first.method.name,
        "k": first.method.k_label,
        "repeats": len(group),
        "tokens": len(first.measurement.tokens),
        "tokens_per_second": speed,
        "tokens_per_second_min": min(speeds) if speeds else None,
        "tokens_per_second_max": max(speeds) if speeds else None,
        "time_to_first_token": statistics.median(m.time_to_first_token for m in measurements),
        "acceptance_rate": _ratio(accepted, drafted) if first.method.speculative else None,
        "mean_accepted_length": (
            _ratio(accepted, verify_steps) if first.method.speculative else None
        ),
        "mean_draft_length": _ratio(drafted, verify_steps) if first.method.speculative else None,
        "mean_tree_nodes": _ratio(
            sum(m.tree_nodes for m in measurements), sum(m.tree_rounds for m in measurements)
        ),
        "accepted_lengths": first.measurement.accepted_lengths,
        "speedup": _ratio(speed, plain_speed) if speed is not None and plain_speed else None,
        # mlxspec's own load-invariant estimate, as `generate --json` and the chat show it.
        "estimated_speedup": _median(
            [m.estimated_speedup for m in measurements if m.estimated_speedup]
        ),
        # Sharded runs only (None in one process): see docs/benchmarks.md.
        "collective_seconds_per_round": _ratio(
            sum(m.collective_seconds for m in measurements),
            sum(m.collective_rounds for m in measurements),
        ),
        # The proposer's share of the runs' time (its draft passes and catch-ups).
        "drafter_share": _ratio(
            sum(m.drafter_seconds for m in measurements),
            sum(m.total_seconds for m in measurements),
        ),
        "token_match": divergence is None,
        "divergence": asdict(divergence) if divergence else None,
    }


def geometric_mean(values: list[float]) -> float | None:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def summarize(rows: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Geometric-mean speedup per method and prompt class, plus over all prompts."""
    classes = list(dict.fromkeys(row["class"] for row in rows))
    summary: dict[str, dict[str, float | None]] = {}
    for method in dict.fromkeys(row["method"] for row in rows):
        mine = [row for row in rows if row["method"] == method and row["speedup"] is not None]
        summary[method] = {
            kind: geometric_mean([row["speedup"] for row in mine if row["class"] == kind])
            for kind in classes
        }
        summary[method][ALL_CLASSES] = geometric_mean([row["speedup"] for row in mine])
    return summary
