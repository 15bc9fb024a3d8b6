"""The synthetic-acceptance proposer and bench: a known acceptance, lossless output, and
what the verify-cost curve predicts for it."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from tiny_models import byte_tokenizer, tiny_model

from mlxspec.bench.runners import run_mlxspec
from mlxspec.bench.suites import BenchPrompt
from mlxspec.bench.synthetic import (
    expected_speedup,
    own_timings,
    prediction_widths,
    rounds_speedup,
    run_synthetic,
    synthetic_markdown,
    synthetic_transcript,
)
from mlxspec.cli import main
from mlxspec.decoding.engine import Engine, GenerationSettings
from mlxspec.decoding.policy import expected_tokens
from mlxspec.decoding.verify_cost import VerifyCost
from mlxspec.events import Done, Step
from mlxspec.proposers.synthetic import SyntheticAcceptance

CPU_LIKE_COST = VerifyCost({1: 1.0, 2: 1.13, 4: 1.39, 8: 1.55, 16: 2.05, 32: 3.22, 64: 5.71}, 0.05)
PROMPT = [72, 101, 108, 108, 111]
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def engine_and_plain():
    engine = Engine(tiny_model("llama"), byte_tokenizer(), verify_cost=CPU_LIKE_COST)
    plain = list(engine.stream(PROMPT, GenerationSettings(max_tokens=MAX_TOKENS)))[-1]
    assert len(plain.token_ids) == MAX_TOKENS  # no early EOS: enough rounds to count
    return engine, list(plain.token_ids)


def synthetic_run(engine, plain, acceptance: float, k: int | None, seed: int = 0):
    engine.add_proposer(
        SyntheticAcceptance([*PROMPT, *plain], acceptance, engine.vocab_size, seed=seed, k_max=8)
    )
    settings = GenerationSettings(max_tokens=MAX_TOKENS, k=k)
    return list(engine.stream(PROMPT, settings, "synthetic"))


def realised_acceptance(events) -> float:
    """Per-token acceptance as the target decided it: kept drafts over draft positions
    reached (the kept ones and each round's first rejected one)."""
    steps = [e for e in events if isinstance(e, Step) and e.drafted]
    kept = sum(s.accepted for s in steps)
    return kept / (kept + sum(s.accepted < s.drafted for s in steps))


@pytest.mark.parametrize("acceptance", [0.5, 0.9])
def test_the_target_accepts_synthetic_drafts_at_the_asked_rate(engine_and_plain, acceptance):
    engine, plain = engine_and_plain
    rates = [
        realised_acceptance(synthetic_run(engine, plain, acceptance, 4, seed)) for seed in (0, 1)
    ]
    assert sum(rates) / len(rates) == pytest.approx(acceptance, abs=0.08), rates


def test_a_corrupted_draft_token_never_equals_the_target_s_own(engine_and_plain):
    engine, plain = engine_and_plain
    events = synthetic_run(engine, plain, 0.0, 4)
    assert realised_acceptance(events) == 0.0


@pytest.mark.parametrize("k", [4, None])
@pytest.mark.parametrize("acceptance", [0.5, 0.9])
def test_synthetic_drafts_leave_the_output_equal_to_plain(engine_and_plain, acceptance, k):
    engine, plain = engine_and_plain
    done = synthetic_run(engine, plain, acceptance, k)[-1]
    assert isinstance(done, Done) and done.record.drafted > 0
    assert list(done.token_ids) == plain


def test_the_curve_predicts_tokens_per_plain_step():
    assert expected_speedup(CPU_LIKE_COST, 0.9, 8) == pytest.approx(
        expected_tokens(0.9, 8) / CPU_LIKE_COST(9)
    )
    adaptive = expected_speedup(CPU_LIKE_COST, 0.9, None)
    assert adaptive >= max(expected_speedup(CPU_LIKE_COST, 0.9, k) for k in range(1, 17))
    assert expected_speedup(CPU_LIKE_COST, 0.0, None) == 1.0  # nothing to gain: plain


class TinyRuntime:
    def __init__(self, engine):
        self.engine = engine


def tiny_bench_engine(monkeypatch, tokenizer=None) -> Engine:
    engine = Engine(tiny_model("llama"), tokenizer or byte_tokenizer(), verify_cost=CPU_LIKE_COST)
    monkeypatch.setattr(engine, "encode_chat", lambda messages: list(PROMPT))
    return engine


def test_the_bench_rows_report_measured_and_predicted_speedups(monkeypatch):
    engine = tiny_bench_engine(monkeypatch)
    prompt = BenchPrompt("p", "chat", "hello")
    result = run_synthetic(TinyRuntime(engine), [prompt], 40, 1, lambda _: None, (0.9,), (4, None))
    rows = result["rows"]
    assert [(r["acceptance"], r["k"]) for r in rows] == [(0.9, 4), (0.9, "adaptive")]
    assert all(r["token_match"] and r["speedup"] and r["expected_speedup"] > 1 for r in rows)
    assert all(r["expected_for_rounds"] > 1 and r["of_expected_for_rounds"] for r in rows)
    assert "| 0.9 | 4 |" in synthetic_markdown(result)
    # The prediction's curve is timed at the widths the rows verify, not interpolated.
    assert sorted(result["verify_cost"]["points"]) == list(range(1, 18))


def test_the_prediction_is_timed_at_each_row_s_verify_width():
    assert prediction_widths((4,)) == (1, 2, 3, 4, 5)  # an answer's last rounds draft less
    assert prediction_widths((8, None)) == tuple(range(1, 18))


def test_the_prediction_prices_each_width_by_its_own_timing():
    """A slow timing at a narrow width must not price the wider ones (the engine's
    running max would): only a price below one step is raised to it."""
    assert own_timings([1.0, 4.1, 1.5, 0.9]) == [1.0, 4.1, 1.5, 1.0]


def test_the_rounds_prediction_prices_each_round_at_its_own_draft():
    """An engine without overhead, on the rounds the engine ran: a last round of 2 drafts
    yields and costs what 2 drafts do, a round at the stop (nothing drafted) one step."""
    full = rounds_speedup(CPU_LIKE_COST, 0.9, [8, 8, 8])
    assert full == pytest.approx(expected_speedup(CPU_LIKE_COST, 0.9, 8))
    tokens = 3 * expected_tokens(0.9, 8) + expected_tokens(0.9, 2) + 1
    steps = 3 * CPU_LIKE_COST(9) + CPU_LIKE_COST(3) + 1
    assert rounds_speedup(CPU_LIKE_COST, 0.9, [8, 8, 8, 2, 0]) == pytest.approx(tokens / steps)
    assert rounds_speedup(CPU_LIKE_COST, 0.9, []) is None


def test_a_run_counts_the_drafts_of_each_timed_round(engine_and_plain):
    """The rounds the decode rate times (all but the first) and what each drafted."""
    engine, plain = engine_and_plain
    engine.add_proposer(
        SyntheticAcceptance([*PROMPT, *plain], 0.9, engine.vocab_size, seed=0, k_max=8)
    )
    events: list = []

    def stream(*args):
        for event in engine.stream(*args):
            events.append(event)
            yield event

    measured = run_mlxspec(engine, PROMPT, MAX_TOKENS, "synthetic", 8, stream=stream)
    steps = [e.drafted for e in events if isinstance(e, Step)]
    assert measured.round_drafts == steps[1:] and max(steps) == 8


def test_an_answer_that_stops_early_is_drafted_to_its_stop_token(engine_and_plain):
    """The stop token ends the transcript, so the last round drafts it like any other
    token (without it that round ran plain: a cost the prediction does not count)."""
    _, plain = engine_and_plain
    stop = plain[20]
    cut = plain[: plain.index(stop)]
    assert synthetic_transcript(PROMPT, plain, MAX_TOKENS, stop) == [*PROMPT, *plain]
    transcript = synthetic_transcript(PROMPT, cut, MAX_TOKENS, stop)
    assert transcript == [*PROMPT, *cut, stop]
    tokenizer = byte_tokenizer()
    tokenizer.eos_token_ids = [stop]
    engine = Engine(tiny_model("llama"), tokenizer, verify_cost=CPU_LIKE_COST)
    engine.add_proposer(SyntheticAcceptance(transcript, 1.0, engine.vocab_size, k_max=4))
    events = list(
        engine.stream(PROMPT, GenerationSettings(max_tokens=MAX_TOKENS, k=4), "synthetic")
    )
    assert list(events[-1].token_ids) == cut
    drafted = [e.drafted for e in events if isinstance(e, Step)]
    assert sum(drafted) == len(cut) + 1 - (len(drafted) - 1)  # every token but the bonuses


def test_a_short_answer_is_said_to_make_a_noisy_row(monkeypatch, engine_and_plain):
    _, plain = engine_and_plain
    tokenizer = byte_tokenizer()
    tokenizer.eos_token_ids = [plain[30]]
    engine = tiny_bench_engine(monkeypatch, tokenizer)
    notes: list[str] = []
    run_synthetic(
        TinyRuntime(engine), [BenchPrompt("p", "chat", "hi")], 100, 1, notes.append, (1.0,), (4,)
    )
    length = plain.index(plain[30])
    assert any(f"the plain answer is {length} tokens" in note for note in notes)


@pytest.mark.parametrize(
    "args",
    [["--k", "8"], ["--synthetic-acceptance", "0.9", "--k", "0"], ["--synthetic-acceptance", "2"]],
)
def test_bad_synthetic_options_get_one_line(args):
    result = CliRunner().invoke(main, ["bench", *args])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "Error" in result.output
