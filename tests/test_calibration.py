"""Calibration never stalls an answer: a time-bounded measurement, a conservative curve
where it ran out, and online pricing from the passes the engine really runs."""

from __future__ import annotations

import json
import time

import pytest
from tiny_models import FAMILIES, byte_tokenizer, tiny_model

from mlxspec.batch.single import SingleCaches
from mlxspec.decoding import engine as engine_module
from mlxspec.decoding.engine import Engine, GenerationSettings
from mlxspec.decoding.policy import Policy
from mlxspec.decoding.verify_cost import (
    CALIBRATION_BUDGET_S,
    LONG_CONTEXT,
    LONG_PRICED_FROM,
    MEASURE_ORDER,
    PARTIAL_REMEASURES,
    VerifyCost,
    cached_verify_cost,
    calibrate,
    measure_verify_cost,
)
from mlxspec.events import Done, Step
from mlxspec.models.kv_form import KVForm
from mlxspec.proposers import PromptLookup, Situation
from mlxspec.proposers.synthetic import SyntheticAcceptance

# Heads of 32 values, which a group of 32 quantizes (as in test_kv_quantized).
WIDE_HEADS = dict(FAMILIES["llama"], num_attention_heads=2, num_key_value_heads=2)
CPU_LIKE_COST = VerifyCost({1: 1.0, 2: 1.13, 4: 1.39, 8: 1.55, 16: 2.05, 32: 3.22, 64: 5.71}, 0.05)


class Named:
    cost_hint = 0.0

    def __init__(self, name: str):
        self.name = name


def quantized_cpu_like(m: int) -> float:
    """Seconds for a pass of m tokens where wide passes are slow: 8 tokens cost 6.6 steps."""
    return 0.1 * (1 + 0.8 * (m - 1))


def test_calibration_ends_within_its_budget_and_times_the_narrow_widths_first():
    now, calls = [0.0], []

    def forward(m: int) -> None:
        calls.append(m)
        now[0] += quantized_cpu_like(m)

    cost = calibrate(forward, lambda: None, clock=lambda: now[0], budget=2.0)
    assert now[0] <= 2.0, calls  # its one-token warm-up included
    assert len(calls) < 1 + 6 * len(MEASURE_ORDER)  # the unbounded run: 49 passes, 78 s
    assert {1, 2, 4, 8} <= set(cost.points) and 64 not in cost.points
    assert cost.partial
    assert cost(8) == pytest.approx(quantized_cpu_like(8) / quantized_cpu_like(1), rel=1e-3)


def test_the_budget_counts_the_context_prefill_and_the_warm_up():
    """The user waits for the whole calibration: a slow prefill of its context (a wide
    quantized pass) leaves the budget only the step and a one-token draft."""
    now, calls = [0.0], []

    def forward(m: int) -> None:
        calls.append(m)
        now[0] += quantized_cpu_like(m)

    def prefill() -> None:
        now[0] += 1.6

    cost = calibrate(forward, lambda: None, clock=lambda: now[0], budget=2.0, prepare=prefill)
    assert calls == [1, 1, 2] and set(cost.points) == {1, 2}
    assert now[0] <= 2.0


def test_a_width_s_first_pass_compiling_its_kernels_never_prices_it():
    """MLX's CUDA backend compiles a width's kernels on its first pass: an H100 spent 33 s
    on the first 8-token pass of the calibration, which priced 8 tokens at 8140 steps (and
    the cache kept it). Timed again, a width's cold pass no longer counts; timed once, it
    is priced no dearer than proportional to the narrower widths."""
    now, seen = [0.0], set()

    def forward(m: int) -> None:
        compile_seconds = 0.0 if m in seen else 30.0 if m >= 8 else 0.01
        now[0] += 0.004 * (1 + 0.05 * (m - 1)) + compile_seconds
        seen.add(m)

    cost = calibrate(forward, lambda: None, clock=lambda: now[0], budget=2.0)
    assert set(cost.points) == {1, 2, 4, 8} and cost.partial
    for m, price in cost.points.items():
        assert price <= m, cost.points  # proportional at most: never the compile's 1000x

    now[0], seen = 0.0, set()  # compiles of 10 ms: every width is timed again, warm
    cost = calibrate(forward, lambda: None, clock=lambda: now[0], budget=2.0, order=(1, 2, 4))
    assert cost.points == pytest.approx({1: 1.0, 2: 1.05, 4: 1.15}), cost.points


def test_a_partial_curve_is_measured_again_by_the_next_runs_then_kept(tmp_path, monkeypatch):
    """The budget ended a first calibration on cold passes (a GPU compiling its kernels):
    the next runs measure it again, each width keeping its cheaper price, until it is
    complete or PARTIAL_REMEASURES runs tried; a complete curve is measured once."""
    monkeypatch.setenv("MLXSPEC_CACHE", str(tmp_path))
    calls: list[str] = []

    def measured(points: dict[int, float], partial: bool = True):
        def measure() -> VerifyCost:
            calls.append(str(points))
            return VerifyCost(points, 0.004, partial=partial)

        return measure

    cached_verify_cost("gpu", measured({1: 1.0, 2: 1.1, 4: 4.0}))
    again = cached_verify_cost("gpu", measured({1: 1.0, 2: 1.3, 4: 1.2, 8: 1.4}))
    assert again.points == {1: 1.0, 2: 1.1, 4: 1.2, 8: 1.4} and again.measurements == 2
    for _ in range(PARTIAL_REMEASURES + 2):
        kept = cached_verify_cost("gpu", measured({1: 1.0, 2: 1.1, 4: 1.2, 8: 1.4}))
    assert len(calls) == 1 + PARTIAL_REMEASURES and kept.partial

    complete = measured({1: 1.0, 2: 1.1}, partial=False)
    cached_verify_cost("cpu", measured({1: 1.0, 2: 1.5}))
    assert not cached_verify_cost("cpu", complete).partial  # a complete one ends the retries
    assert cached_verify_cost("cpu", complete).measurements == 2
    assert len(calls) == 1 + PARTIAL_REMEASURES + 2


def test_a_machine_too_busy_for_the_budget_still_times_a_one_token_draft():
    """Steps of 1.5 s (a loaded machine): past the budget after one timing, yet the
    narrowest draft's verify is timed, so the policy can still draft one token."""
    now, calls = [0.0], []

    def forward(m: int) -> None:
        calls.append(m)
        now[0] += 1.5 * (1 + 0.05 * (m - 1))

    cost = calibrate(forward, lambda: None, clock=lambda: now[0], budget=2.0)
    assert calls == [1, 1, 2] and cost(2) == pytest.approx(1.05)


def test_widths_a_budget_left_untimed_are_priced_as_proportional():
    """No cheaper than the widest timed size scaled up: a partial curve never invites a
    wide draft it has not seen (the last slope of 1.1 -> 1.2 would price 64 at 7.3)."""
    partial = VerifyCost({1: 1.0, 2: 1.1, 4: 1.2}, 0.1, partial=True)
    assert partial(64) == pytest.approx(1.2 * 16)
    assert partial(3) == pytest.approx(1.15)  # inside the timed range: interpolated
    full = VerifyCost({1: 1.0, 2: 1.1, 4: 1.2}, 0.1)
    assert full(64) < partial(64)
    assert VerifyCost.from_json(partial.to_json()) == partial


class SlowModel:
    """Counts and slows every forward pass of a model: 30 ms a token on top of its own."""

    def __init__(self, model, seconds_per_token: float = 0.03):
        self.fed: list[int] = []
        base = type(model)
        fed, per_token = self.fed, seconds_per_token

        class Slowed(base):
            def __call__(self, inputs, *args, **kwargs):
                fed.append(inputs.shape[-1])
                time.sleep(per_token * inputs.size)
                return base.__call__(self, inputs, *args, **kwargs)

        model.__class__ = Slowed
        self.model = model


def test_a_first_speculative_request_on_a_slow_model_waits_at_most_the_budget(
    tmp_path, monkeypatch
):
    """A fresh cache, passes that cost 30 ms a token: the unbounded calibration fed 785
    tokens (24 s) before the first answer; bounded, at most what the budget pays for."""
    monkeypatch.setenv("MLXSPEC_CACHE", str(tmp_path))
    slow = SlowModel(tiny_model("llama"))
    tokenizer = byte_tokenizer()
    prompt = [5, 6, 7, 8]
    plain = Engine(tiny_model("llama"), tokenizer)
    answer = list(plain.stream(prompt, GenerationSettings(max_tokens=8)))[-1].token_ids
    transcript = [*prompt, *answer]
    synthetic = SyntheticAcceptance(transcript, 0.9, plain.vocab_size)
    notes: list[str] = []
    engine = Engine(slow.model, tokenizer, "slow", [synthetic], notify=notes.append)
    cost = engine.verify_cost
    calibration_tokens = sum(slow.fed)
    widest = max(cost.points)
    assert calibration_tokens <= 4 + 1 + CALIBRATION_BUDGET_S / 0.03 + widest, slow.fed
    assert cost.partial and any("priced" in note for note in notes)
    done = list(engine.stream(prompt, GenerationSettings(max_tokens=8), "synthetic"))[-1]
    assert isinstance(done, Done) and done.record.speculative


def test_a_wide_pass_far_dearer_than_priced_turns_drafting_off_at_once(monkeypatch):
    """The curve says 9 tokens cost 1.55 steps; each extra token really costs 30 ms (about
    15 steps of this model): the H100's quantized wide passes. Drafts that are always
    right must not keep k = 8 going: after the first dear round the policy times plain
    rounds, re-prices every width and drafts at most a probe's one token after."""
    verify = SingleCaches.verify

    def slow_verify(self, rows):
        time.sleep(0.03 * (len(rows[0]) - 1))
        return verify(self, rows)

    monkeypatch.setattr(SingleCaches, "verify", slow_verify)
    tokenizer, prompt = byte_tokenizer(), [5, 6, 7, 8]
    engine = Engine(tiny_model("llama"), tokenizer, verify_cost=CPU_LIKE_COST)
    plain = list(engine.stream(prompt, GenerationSettings(max_tokens=80)))[-1].token_ids
    engine.add_proposer(SyntheticAcceptance([*prompt, *plain], 1.0, engine.vocab_size, k_max=8))
    steps = [
        e
        for e in engine.stream(prompt, GenerationSettings(max_tokens=80), "synthetic")
        if isinstance(e, Step)
    ]
    wide = [i for i, step in enumerate(steps) if step.drafted > 1]
    # Priced on the curve, all 9 rounds would draft 8; a hiccup in both re-timing rounds
    # (a loaded machine) may cost one more wide round before the price stands.
    assert len(wide) <= 3 and wide[-1] <= 6, [s.drafted for s in steps]


def test_a_jump_in_price_is_undone_by_the_first_pass_after_the_plain_round():
    """One busy moment (a 9-token pass 4x dear) must not keep speculation off: the plain
    rounds after it re-time the step, and the next pass that costs what the curve said
    (here the probe) brings the price back at once."""
    policy = Policy(CPU_LIKE_COST)
    copying = Situation(Named("copying"), "c", prior=0.9)
    calm = policy.choose(copying, 8)
    policy.observe_verify(1, 0.05)
    policy.observe_verify(9, 4 * 0.05 * CPU_LIKE_COST(9))
    for hiccup in (0.5, 1.0):  # two plain rounds re-time the step; the fastest counts
        assert policy.choose(copying, 8) == 0
        policy.observe_verify(1, 0.05 / hiccup)
    assert policy.step_seconds == pytest.approx(0.05)
    assert policy.choose(copying, 8) < calm  # the dear price stands until a pass refutes it
    policy.observe_verify(2, 0.05 * CPU_LIKE_COST(2))
    assert policy.extra_cost_scale == pytest.approx(1.0)
    assert policy.choose(copying, 8) == calm


def test_online_passes_refine_a_curve_measured_in_a_busy_moment():
    """Calibrated while another job ran, wide passes looked 2x dearer than they are: the
    passes run while decoding bring the price down and the drafts grow."""
    busy = VerifyCost({m: 1 + 2 * (c - 1) for m, c in CPU_LIKE_COST.points.items()}, 0.05)
    policy = Policy(busy)
    copying = Situation(Named("copying"), "c", prior=0.6)
    before = policy.choose(copying, 16)
    for _ in range(30):
        k = policy.choose(copying, 16) or 1
        policy.observe_verify(1, 0.05)
        policy.observe_verify(k + 1, 0.05 * CPU_LIKE_COST(k + 1))
    assert policy.verify_cost(9) == pytest.approx(CPU_LIKE_COST(9), rel=0.1)
    assert policy.choose(copying, 16) > before


def test_a_long_request_measures_the_long_context_curve_once_and_keeps_it_apart(
    tmp_path, monkeypatch
):
    """A short prompt prices by the short curve alone; the first of LONG_PRICED_FROM
    tokens or more measures the curve behind LONG_CONTEXT (synthetic KV), kept
    under a key of its own: a later process reads both back, neither mistaken for the
    other, and the rounds are priced at their context length."""
    monkeypatch.setenv("MLXSPEC_CACHE", str(tmp_path))
    model, tokenizer = tiny_model("llama"), byte_tokenizer()
    engine = Engine(model, tokenizer, "tiny", [PromptLookup()])
    settings = GenerationSettings(max_tokens=8)
    list(engine.stream([5, 6, 7, 8] * 10, settings, "prompt-lookup"))
    policy = engine.kept_policy(engine.proposers["prompt-lookup"], None)
    assert policy.long_cost is None and policy.context >= 40
    prompt = [5, 6, 7, 8, 9] * (LONG_PRICED_FROM // 5 + 1)
    done = list(engine.stream(prompt, settings, "prompt-lookup"))[-1]
    assert isinstance(done, Done)
    assert policy.long_cost is not None and policy.context >= len(prompt)
    short, long = engine.verify_cost, policy.long_cost
    assert (short.context, long.context) == (4, LONG_CONTEXT)
    kept = json.loads((tmp_path / "calibration.json").read_text())
    assert len(kept) == 2 and sum(key.endswith(f"|context {LONG_CONTEXT}") for key in kept) == 1

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(engine_module, "measure_verify_cost", no_measuring)
    later = Engine(model, tokenizer, "tiny", [PromptLookup()])
    assert later.verify_cost == short and later.long_verify_cost == long


@pytest.mark.parametrize("family", ["gemma3_text", "lfm2"])
def test_a_cache_that_is_not_plain_attention_keeps_the_one_curve(family, tmp_path, monkeypatch):
    """A sliding window's or a recurrent layer's cache cannot be filled with random KV:
    a long prompt on such a model measures nothing more and is priced as before."""
    monkeypatch.setenv("MLXSPEC_CACHE", str(tmp_path))
    engine = Engine(tiny_model(family), byte_tokenizer(), family, [PromptLookup()])
    prompt = [5, 6, 7, 8, 9] * (LONG_PRICED_FROM // 5 + 1)
    done = list(engine.stream(prompt, GenerationSettings(max_tokens=4), "prompt-lookup"))[-1]
    assert isinstance(done, Done)
    assert engine.kept_policy(engine.proposers["prompt-lookup"], None).long_cost is None
    assert len(json.loads((tmp_path / "calibration.json").read_text())) == 1


class OffsetsSeen:
    """A model that notes the cache's length before each pass (the calibration's
    context plus nothing: each timing starts from the same context)."""

    def __init__(self, model):
        self.model, self.offsets = model, []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, inputs, cache):
        self.offsets.append(cache[0].offset)
        return self.model(inputs, cache=cache)


@pytest.mark.parametrize("kv", [None, KVForm(8, 32, 0)], ids=["float", "q8"])
@pytest.mark.parametrize("synthetic", [False, True], ids=["prefilled", "synthetic"])
def test_every_timed_pass_runs_behind_the_same_context(kv, synthetic):
    """Each timing is rolled back to the calibration's context, quantized KV too (its
    layers' size() is 0: trimmed by it, every roll-back added the context instead, and
    behind 4,096 tokens the next pass failed)."""
    model = OffsetsSeen(tiny_model("llama", config=WIDE_HEADS))
    how = {"kv": kv} if kv else {}
    measure_verify_cost(model, 256, context=600, synthetic=synthetic, budget=None, **how)
    assert set(model.offsets[-30:]) == {600}
