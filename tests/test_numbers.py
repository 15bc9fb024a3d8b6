"""The numbers on screen: the speedup estimate against the bench, calibration progress."""

from __future__ import annotations

import sys

import pytest

from mlxspec import console
from mlxspec.bench.methods import PLAIN, Method
from mlxspec.bench.rows import build_rows
from mlxspec.bench.session import Bench
from mlxspec.bench.suites import BenchPrompt
from mlxspec.decoding.verify_cost import CALIBRATION_SIZES, calibrate
from mlxspec.events import ProgressNote
from mlxspec.registry.models_toml import load_registry
from mlxspec.registry.runtime import Runtime
from mlxspec.speedup import SpeedupEstimate, round_steps

COPY_PROMPT = (
    "Copy this text exactly, word for word:\n\nThe quick brown fox jumps over the lazy dog. "
    "The five boxing wizards jump quickly. Pack my box with five dozen liquor jugs. How "
    "vexingly quick daft zebras jump. Sphinx of black quartz, judge my vow."
)


def test_a_round_is_priced_with_its_own_times_so_load_cancels():
    """A verify of 8 tokens that costs 1.5 steps took 0.3 s, the whole round 0.4 s: a step
    takes 0.2 s right now, so the round cost 2 steps; twice as busy, still 2."""
    assert round_steps(0.4, 0.3, 1.5) == pytest.approx(2.0)
    assert round_steps(0.8, 0.6, 1.5) == pytest.approx(2.0)
    estimate = SpeedupEstimate()
    estimate.add_round(6, round_steps(0.4, 0.3, 1.5))  # 5 drafts kept + the target's own
    estimate.add_round(1, round_steps(0.22, 0.2, 1.0))  # a plain round, 10% bookkeeping
    assert estimate.value == pytest.approx(7 / 3.1)


class Notes(list):
    def append_args(self, *args):  # progress(done, total, size)
        self.append(args)


def test_calibration_reports_progress_before_every_pass():
    calls, notes = [], Notes()
    calibrate(lambda m: calls.append(m), lambda: None, repeats=2, progress=notes.append_args)
    total = len(calls)
    assert total == 1 + len(CALIBRATION_SIZES) * 3  # a warm-up pass, then 3 rounds
    assert [done for done, _, _ in notes] == list(range(total + 1))
    assert {t for _, t, _ in notes} == {total}
    assert [size for _, _, size in notes[:-1]] == calls  # each note names the coming pass


@pytest.mark.parametrize("terminal", [True, False])
def test_progress_notes_share_one_line(monkeypatch, capsys, terminal):
    """On a terminal each note overwrites the last; in a log, only the first and last."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: terminal)
    for done in range(4):
        console.say(ProgressNote(f"measuring {done}/3", done, 3))
    console.say("loaded")
    err = capsys.readouterr().err
    if terminal:
        assert err.count("\n") == 2 and err.count("\r") == 4  # the note's line, "loaded"
    else:
        assert err.splitlines() == [
            "mlxspec: measuring 0/3",
            "mlxspec: measuring 3/3",
            "mlxspec: loaded",
        ]


@pytest.mark.slow
@pytest.mark.alone  # a timing held to a ratio (tests/side_by_side.py)
def test_estimated_speedup_agrees_with_the_bench(smollm2):
    """On a copy prompt, what `generate --json` and the chat show (the run record's
    estimated_speedup, over plain decoding) agrees with what `mlxspec bench` measures in
    the same run: spec tok/s over mlxspec's own plain decoding (`--proposer none`),
    medians of 3 interleaved repeats. Not over mlx-lm's plain loop, whose token cost
    7-35% more or less than the engine's own plain one on this CPU, quiet to loaded.
    The band is lopsided because the estimate reads low on this 2-core CPU: 0.70-0.97 of
    the measured ratio in the sixth pass's eight benches (quiet alone 0.79-0.97; in the
    full suite 0.70 and 0.74, which failed the old 25% either way; see
    docs/design/test-suite.md). The round's arithmetic (its verify's cost, its other work)
    is held exactly by the test above. What this one catches is the figure the user reads
    far off what happened: rounds priced without their verify's cost read high (seen
    failing), a copy prompt that no longer speculates fails `measured > 1.2`."""
    entry = load_registry().get("smollm2-135m")
    runtime = Runtime(entry, smollm2, notify=lambda _: None)
    plain, spec = Method("mlxspec", "none"), Method("mlxspec", "prompt-lookup")
    prompt = BenchPrompt("copy", "copy", COPY_PROMPT)
    # plain-mlx-lm leads every bench, but nothing here reads its rows: they are left out
    # of the timed plan (a third of the test's time). Each spec row is still checked
    # against the first row run, mlxspec's own plain decoding.
    methods = [Method(PLAIN), plain, spec]
    bench = Bench(runtime, [prompt], methods, max_tokens=64, repeats=3)
    bench.plan = [(p, repeat, method) for p, repeat, method in bench.plan if method != methods[0]]
    bench.prepare()
    seen = []
    # The measured side is a timing on a shared machine: a burst of other work during one
    # bench (seen: 3.37x estimated vs 4.01x measured while another job trained a model)
    # earns one more bench. An estimate that is really off fails both.
    for _ in range(2):
        rows = {r["method"]: r for r in build_rows(list(bench.runs()))}
        measured = rows[spec.name]["tokens_per_second"] / rows[plain.name]["tokens_per_second"]
        estimated = rows[spec.name]["estimated_speedup"]
        assert measured > 1.2, f"the copy prompt should speculate well; measured {measured:.2f}x"
        seen.append(f"estimated {estimated:.2f}x (run record) vs measured {measured:.2f}x")
        if 0.65 <= estimated / measured <= 1.1:
            return
    raise AssertionError("; ".join(seen))
