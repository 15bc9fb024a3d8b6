"""Progress bars for long drafter work (teacher data, self-distilled answers).

A leaf: the training command and the answer generator both draw bars, and neither should
import the other for it.
"""

from __future__ import annotations

from collections.abc import Callable

from tqdm import tqdm


def progress_bar(description: str) -> Callable[[int, int], None]:
    """A progress callback (done, total) drawing a tqdm bar; the bar starts at the first
    report, at what an earlier run already did, so its rate counts only this run."""
    bar: list[tqdm] = []

    def update(done: int, total: int) -> None:
        if not bar:
            bar.append(tqdm(total=total, initial=done, desc=description, unit="seq"))
        bar[0].update(done - bar[0].n)
        if done >= total:
            bar[0].close()

    return update
