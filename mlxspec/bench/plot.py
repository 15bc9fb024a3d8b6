"""The optional PNG: speedup per prompt class and method (needs the `plot` extra)."""

from __future__ import annotations

from pathlib import Path

from mlxspec.bench import BenchError
from mlxspec.bench.methods import PLAIN

MISSING = "--plot needs matplotlib; install it with: pip install 'mlxspec[plot]'"


def require_matplotlib() -> None:
    """Fail before the bench starts rather than after it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise BenchError(MISSING) from None


def save_plot(summary: dict[str, dict[str, float | None]], path: Path, title: str) -> None:
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    methods = [m for m in summary if m != PLAIN]
    classes = list(next(iter(summary.values()))) if summary else []
    width = 0.8 / max(len(methods), 1)
    figure, axes = plt.subplots(figsize=(max(6, 1.6 * len(classes) + 2), 4.5))
    for i, method in enumerate(methods):
        heights = [summary[method][kind] or 0 for kind in classes]
        positions = [c + (i - (len(methods) - 1) / 2) * width for c in range(len(classes))]
        axes.bar(positions, heights, width, label=method)
    axes.axhline(1.0, color="black", linewidth=1, linestyle="--", label=PLAIN)
    axes.set_xticks(range(len(classes)), classes)
    axes.set_ylabel("speedup vs plain-mlx-lm (geometric mean)")
    axes.set_title(title)
    axes.legend(fontsize="small", ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
