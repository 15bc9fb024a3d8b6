"""The bench result as one JSON document and as markdown tables."""

from __future__ import annotations

import statistics
from typing import Any

from mlxspec.bench.machine import roofline
from mlxspec.bench.methods import PLAIN
from mlxspec.bench.rows import ALL_CLASSES, build_rows, summarize
from mlxspec.bench.run import Run

TABLE_COLUMNS = (
    "prompt",
    "class",
    "method",
    "k",
    "tok/s (min-max)",
    "TTFT s",
    "accept",
    "acc len",
    "speedup",
    "est.",
    "token match",
)
COLLECTIVE_COLUMN = "coll. ms/round"  # sharded runs only


def document(
    machine: dict[str, Any],
    model: dict[str, Any],
    settings: dict[str, Any],
    runs: list[Run],
    bandwidth: float,
    interrupted: bool = False,
    sharded: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """`{"machine", "model", "settings", "rows", "summary"}`; the roofline sits in machine.
    `sharded` ({"ranks", "backend", "parallel"}): every row ran on the sharded target."""
    rows = build_rows(runs)
    plain = [
        r["tokens_per_second"] for r in rows if r["method"] == PLAIN and r["tokens_per_second"]
    ]
    plain_speed = statistics.median(plain) if plain else None
    result = {
        "machine": {**machine, "roofline": roofline(model["weight_bytes"], bandwidth, plain_speed)},
        "model": model,
        "settings": settings,
        "rows": rows,
        "summary": summarize(rows),
        "interrupted": interrupted,
    }
    return {**result, "sharded": sharded} if sharded else result


def markdown(result: dict[str, Any]) -> str:
    machine, model = result["machine"], result["model"]
    roof = machine["roofline"]
    lines = [
        f"## mlxspec bench: {model['name']}",
        "",
        f"- machine: {machine['cpu']} ({machine['cores']} cores, "
        f"{_gib(machine['memory_bytes'])}), {machine['os']}",
        f"- device: {machine['device']}, BLAS {machine['blas']}, mlx {machine['mlx']}, "
        f"mlx-lm {machine['mlx_lm']}",
        f"- roofline: {roof['weight_bytes'] / 1e6:.0f} MB of weights at "
        f"{roof['bandwidth_bytes_per_second'] / 1e9:.1f} GB/s = "
        f"{roof['ceiling_tokens_per_second']:.1f} tok/s ceiling; plain-mlx-lm reaches "
        f"{number_cell(roof['plain_percent_of_ceiling'], '.0f')}%",
        f"- settings: greedy, max {result['settings']['max_tokens']} tokens, "
        f"{result['settings']['repeats']} repeat(s), decode tok/s excludes the first round",
    ]
    if sharded := result.get("sharded"):
        lines.append(
            f"- sharded: every row ran on the target split over {sharded['ranks']} ranks "
            f"({sharded['backend']}, {sharded['parallel']} parallel), plain-mlx-lm included; "
            "weights and roofline are one rank's shard"
        )
    if result["interrupted"]:
        lines.append("- INTERRUPTED: partial results")
    table = table_lines(result["rows"], collectives="sharded" in result)
    lines += ["", *table, "", *summary_lines(result["summary"])]
    return "\n".join(lines) + "\n"


def table_lines(rows: list[dict[str, Any]], collectives: bool = False) -> list[str]:
    """`collectives`: a sharded run's table, with mlxspec's collective time per round."""
    if not collectives:
        return markdown_table(TABLE_COLUMNS, [_cells(row) for row in rows])
    header = (*TABLE_COLUMNS[:-1], COLLECTIVE_COLUMN, TABLE_COLUMNS[-1])
    body = []
    for row in rows:
        cells = _cells(row)
        per_round = row.get("collective_seconds_per_round")
        per_round_ms = None if per_round is None else per_round * 1000
        body.append([*cells[:-1], number_cell(per_round_ms, ".2f"), cells[-1]])
    return markdown_table(header, body)


def summary_lines(summary: dict[str, dict[str, float | None]]) -> list[str]:
    """Geometric-mean speedup vs plain-mlx-lm, per method and prompt class."""
    if not summary:
        return []
    classes = list(next(iter(summary.values())))
    body = [
        [method, *(number_cell(speedups[kind], ".2f", "x") for kind in classes)]
        for method, speedups in summary.items()
    ]
    header = ("method", *(f"{kind} (geomean)" if kind == ALL_CLASSES else kind for kind in classes))
    return [
        "Speedup vs plain-mlx-lm (geometric mean per prompt class):",
        "",
        *markdown_table(header, body),
    ]


def _cells(row: dict[str, Any]) -> list[str]:
    speed = number_cell(row["tokens_per_second"], ".1f")
    if row["repeats"] > 1 and row["tokens_per_second"] is not None:
        speed += f" ({row['tokens_per_second_min']:.1f}-{row['tokens_per_second_max']:.1f})"
    k = row["k"]
    if k == "adaptive" and row["mean_draft_length"] is not None:
        k = f"adaptive {row['mean_draft_length']:.1f}"
    match = "yes"
    if row["divergence"]:
        where = row["divergence"]
        match = f"NO at token {where['position']} (plain top-2 gap {where['plain_top2_gap']:.1e})"
    return [
        row["prompt"],
        row["class"],
        row["method"],
        str(k),
        speed,
        f"{row['time_to_first_token']:.2f}",
        number_cell(row["acceptance_rate"], ".0%"),
        number_cell(row["mean_accepted_length"], ".2f"),
        number_cell(row["speedup"], ".2f", "x"),
        number_cell(row.get("estimated_speedup"), ".2f", "x"),
        match,
    ]


def markdown_table(header, body: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(cells) + " |" for cells in body),
    ]


def number_cell(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _gib(n_bytes: int | None) -> str:
    return "memory unknown" if n_bytes is None else f"{n_bytes / 2**30:.0f} GiB"
