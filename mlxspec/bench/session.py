"""What `mlxspec bench` does between parsing its options and printing: check the request,
run it with progress, and write the outputs. Kept out of the `bench` command so it stays
testable."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxspec.bench import BenchError
from mlxspec.bench.machine import describe_machine, measure_bandwidth
from mlxspec.bench.methods import Method, parse_methods, with_trees
from mlxspec.bench.plot import require_matplotlib, save_plot
from mlxspec.bench.report import document, markdown
from mlxspec.bench.run import Bench, Progress, Run
from mlxspec.bench.runners import Stream
from mlxspec.bench.suites import REPLAYED, BenchPrompt, load_suite, read_prompts
from mlxspec.registry.models_toml import ModelEntry
from mlxspec.registry.runtime import Runtime, parameter_count, weight_bytes

QUICK_REPEATS, REPEATS = 1, 3
REPLAY_METHODS = "prompt-lookup,suffix"  # what a replayed suite compares with plain


@dataclass(frozen=True)
class BenchRequest:
    entry: ModelEntry
    source: str  # "suite quick", or "prompts FILE"
    prompts: list[BenchPrompt]
    methods: list[Method]
    max_tokens: int
    repeats: int
    replay: bool = False  # in order, each method with its own history building up
    left_out: tuple[str, ...] = ()  # methods a sharded target cannot run (tree rows)


class Interrupted(Exception):
    """Ctrl-C during the timed runs: carries the result of the runs measured so far."""

    def __init__(self, result: dict[str, Any], done: int, total: int):
        super().__init__(f"interrupted after {done} of {total} runs")
        self.result, self.done, self.total = result, done, total


def plan(
    entry: ModelEntry,
    suite: str,
    prompts_file: str | Path | None,
    proposers: str | None,
    max_tokens: int,
    repeats: int | None,
    plot: bool = False,
    tree: bool | None = None,
    sharded: bool = False,
    replay: bool = False,
) -> BenchRequest:
    """Check everything that can be checked before loading weights. `sharded`: a sharded
    target verifies lines only, so tree rows are left out (an explicit --tree fails).
    `replay`: the prompts file in order, each method's history building up, as the
    agent suite is run (a stream of the user's own similar requests)."""
    if replay and prompts_file is None:
        raise BenchError("--replay replays a --prompts file (the agent suite is replayed anyway)")
    if sharded and tree:
        raise BenchError("--tree: a sharded target verifies lines only, for now; drop --tree")
    if plot:
        require_matplotlib()
    if prompts_file is not None:
        source, prompts = f"prompts {prompts_file}", read_prompts(Path(prompts_file))
    else:
        source, prompts = f"suite {suite}", load_suite(suite)
    quick = prompts_file is None and suite == "quick"
    replay = replay or (prompts_file is None and suite in REPLAYED)
    # quick stays a few minutes on a laptop CPU: the headline methods, one repeat.
    default = "core" if quick else REPLAY_METHODS if replay else "all"
    methods = with_trees(parse_methods(proposers or default, entry), tree)
    left_out = tuple(m.name for m in methods if sharded and m.tree)
    methods = [m for m in methods if m.name not in left_out]
    if repeats is None:
        repeats = QUICK_REPEATS if quick or replay else REPEATS
    return BenchRequest(entry, source, prompts, methods, max_tokens, repeats, replay, left_out)


def execute(
    request: BenchRequest,
    runtime: Runtime,
    notify: Callable[[str], None],
    progress: Progress,
    sharded: tuple[dict[str, Any], Stream] | None = None,
) -> dict[str, Any]:
    """Prepare, measure the machine, run every timed row; the result document.

    `sharded`: (the setup, the rank session's stream). Every rank executes the same
    request in the same order, so each forward pass (mlx-lm's rows' too) is collective."""
    setup, stream = sharded or (None, None)
    bench = Bench(
        runtime,
        request.prompts,
        request.methods,
        request.max_tokens,
        request.repeats,
        request.replay,
        stream,
    )
    bench.prepare(notify)
    notify("measuring memory bandwidth")
    bandwidth = measure_bandwidth()
    model = runtime.loaded.model
    facts = dict(
        machine=describe_machine(),
        model={
            "name": request.entry.name,
            "target": request.entry.target,
            "weights_dtype": runtime.loaded.weights_dtype,
            "parameters": parameter_count(model),
            "weight_bytes": weight_bytes(model),
        },
        settings={
            "source": request.source,
            "prompts": len(request.prompts),
            "methods": [method.name for method in request.methods],
            "max_tokens": request.max_tokens,
            "repeats": request.repeats,
            "sampling": "greedy",
            "order": (
                "for each repeat, each prompt in order, every method in turn; each method "
                "with its own history, empty at each repeat's start"
                if request.replay
                else (
                    "for each prompt, for each repeat, every method in turn; each run with "
                    "an empty history (a shipped seed history is read)"
                )
            ),
            "decode_rate": "tokens after the first round / seconds after the first round",
        },
    )
    runs: list[Run] = []
    try:
        for run in bench.runs(progress):
            runs.append(run)
    except KeyboardInterrupt:
        result = document(**facts, runs=runs, bandwidth=bandwidth, interrupted=True, sharded=setup)
        raise Interrupted(result, len(runs), bench.total) from None
    return document(**facts, runs=runs, bandwidth=bandwidth, sharded=setup)


def write_outputs(
    result: dict[str, Any],
    json_path: str | Path | None,
    markdown_path: str | Path | None,
    plot_path: str | Path | None,
) -> list[Path]:
    written: list[Path] = []
    try:
        if json_path:
            json_path = Path(json_path)
            json_path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
            written.append(json_path)
        if markdown_path:
            markdown_path = Path(markdown_path)
            markdown_path.write_text(markdown(result), encoding="utf-8")
            written.append(markdown_path)
        if plot_path:
            title = f"mlxspec bench: {result['model']['name']} ({result['machine']['cpu']})"
            save_plot(result["summary"], Path(plot_path), title)
            written.append(Path(plot_path))
    except OSError as err:
        raise BenchError(f"cannot write {err.filename}: {err.strerror}") from None
    return written
