"""A draft model is priced by its step measured beside the target's on this machine, once
per pair (kept in the cache), not guessed from the bytes it reads."""

from __future__ import annotations

import pytest
from tiny_gguf import write_tiny_gguf

from mlxspec.decoding import draft_cost
from mlxspec.decoding.draft_cost import DraftCost, step_ratio
from mlxspec.decoding.draft_form import DraftForm, choose_draft_form
from mlxspec.decoding.policy import Policy
from mlxspec.decoding.verify_cost import VerifyCost
from mlxspec.decoding.weights_choice import held_weights
from mlxspec.proposers import DraftModel
from mlxspec.registry import runtime as runtime_module
from mlxspec.registry.models_toml import load_registry
from mlxspec.registry.runtime import draft_cost_hint, open_runtime


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_step_ratio_keeps_each_models_fastest_step_timed_in_turns():
    clock = FakeClock()
    target_times = iter([9.0, 1.3, 1.0, 1.1, 1.2, 1.0, 1.4, 1.0, 1.1])  # first: untimed, cold
    draft_times = iter([5.0, 0.06, 0.07, 0.05, 0.09, 0.05, 0.05, 0.3, 0.08])

    def advance(times):
        def step():
            clock.now += next(times)

        return step

    ratio = step_ratio(advance(target_times), advance(draft_times), clock, budget=100.0)
    assert ratio == pytest.approx(0.05)


def test_step_ratio_stops_at_its_budget_after_two_rounds():
    clock = FakeClock()
    steps = []

    def slow_target():
        clock.now += 10.0
        steps.append("target")

    def draft():
        clock.now += 1.0

    step_ratio(slow_target, draft, clock, budget=2.0)
    assert steps.count("target") == 1 + 2  # the untimed one, then PAIR_AT_LEAST rounds


@pytest.fixture
def pair_entry(tmp_path, monkeypatch):
    """A tiny GGUF target whose draft model is its own first layer (of 3)."""
    target = write_tiny_gguf(tmp_path / "tiny.Q8_0.gguf", "Q8_0")
    (tmp_path / "models.toml").write_text(
        f'[models.tiny]\ntarget = "{target}"\n[models.tiny.defaults]\nweights = "dequantized"\n'
        f'[models.tiny.proposers.draft-model]\ndraft = "{target}"\ndraft_layers = 1\n'
    )
    monkeypatch.setenv("MLXSPEC_MODELS", str(tmp_path / "models.toml"))
    monkeypatch.setenv("MLXSPEC_CACHE", str(tmp_path / "cache"))
    return load_registry().get("tiny")


def test_a_draft_model_is_priced_by_its_measured_step_not_its_bytes(pair_entry, monkeypatch):
    measured = []

    def fake_measure(draft, target, vocab_size):
        measured.append(vocab_size)
        return DraftCost(0.02, VerifyCost({1: 1.0, 8: 1.5}, 0.001))

    monkeypatch.setattr(runtime_module, "measure_draft_cost", fake_measure)
    runtime = open_runtime(pair_entry)
    draft = runtime.engine.proposers[runtime.proposer("draft-model")]
    guess = draft_cost_hint(draft.model, runtime.loaded.model)
    assert guess > 0.2  # one layer of three, and the embeddings: the bytes say a third
    policy = Policy(VerifyCost({1: 1.0, 2: 1.1}, 0.01))
    assert policy.draft_price(draft) == pytest.approx(0.02)
    assert measured == [runtime.engine.vocab_size]
    # Once per pair: a second runtime reads it from the cache.
    again = open_runtime(pair_entry)
    again.proposer("draft-model")
    assert len(measured) == 1
    assert again.engine.proposers["draft-model"].own_cost.step_ratio == pytest.approx(0.02)


def test_a_real_measurement_of_a_pair(pair_entry, monkeypatch):
    monkeypatch.setattr(draft_cost, "PAIR_REPEATS", 3)
    runtime = open_runtime(pair_entry)
    draft = runtime.engine.proposers[runtime.proposer("draft-model")]
    own = draft.own_cost
    assert isinstance(own, DraftCost)
    assert 0 < own.step_ratio < 5  # one layer of three: timing noise aside, cheaper
    assert own.curve(1) == 1.0 and own.curve.step_seconds > 0


@pytest.fixture
def separate_draft(tmp_path, monkeypatch):
    """A tiny GGUF target (held dequantized) and a separate Q8_0 draft of its family."""
    target = write_tiny_gguf(tmp_path / "tiny.Q8_0.gguf", "Q8_0")
    draft = write_tiny_gguf(tmp_path / "draft.Q8_0.gguf", "Q8_0", seed=1)

    def entry(weights: str | None = None):
        option = f'weights = "{weights}"\n' if weights else ""
        (tmp_path / "models.toml").write_text(
            f'[models.tiny]\ntarget = "{target}"\n[models.tiny.defaults]\n'
            f'weights = "dequantized"\n[models.tiny.proposers.draft-model]\n'
            f'draft = "{draft}"\n{option}'
        )
        return load_registry().get("tiny")

    monkeypatch.setenv("MLXSPEC_MODELS", str(tmp_path / "models.toml"))
    monkeypatch.setenv("MLXSPEC_CACHE", str(tmp_path / "cache"))
    return entry


def priced_by_form(monkeypatch, quantized: float, dequantized: float) -> list[str]:
    """Each form of the draft costs what is given; returns the forms measured, in order."""
    measured = []

    def fake_measure(draft, target, vocab_size):
        form = "quantized" if "q8" in held_weights(draft) else "dequantized"
        measured.append(form)
        ratio = quantized if form == "quantized" else dequantized
        return DraftCost(ratio, VerifyCost({1: 1.0, 8: 1.5}, 0.001))

    monkeypatch.setattr(runtime_module, "measure_draft_cost", fake_measure)
    return measured


def draft_of(runtime) -> DraftModel:
    return runtime.engine.proposers[runtime.proposer("draft-model")]


@pytest.mark.parametrize(
    ("quantized", "dequantized", "kept"), [(0.33, 0.21, "dequantized"), (0.2, 0.19, "quantized")]
)
def test_a_quantized_draft_drafts_in_the_form_measured_cheaper_beside_the_target(
    separate_draft, monkeypatch, quantized, dequantized, kept
):
    """Both forms timed beside the target as it is held, once per pair: the dequantized
    form is kept only when clearly cheaper (it holds several times the bytes)."""
    measured = priced_by_form(monkeypatch, quantized, dequantized)
    draft = draft_of(open_runtime(separate_draft()))
    assert sorted(measured) == ["dequantized", "quantized"]
    assert ("q8" in held_weights(draft.model)) == (kept == "quantized")
    assert draft.own_cost.step_ratio == pytest.approx(
        min(quantized, dequantized) if kept == "dequantized" else quantized
    )
    again = draft_of(open_runtime(separate_draft()))  # decided and priced before: from the cache
    assert len(measured) == 2
    assert ("q8" in held_weights(again.model)) == (kept == "quantized")


def test_a_draft_form_asked_for_is_loaded_without_measuring_the_other(separate_draft, monkeypatch):
    measured = priced_by_form(monkeypatch, 0.5, 0.1)
    draft = draft_of(open_runtime(separate_draft("quantized")))
    assert measured == ["quantized"] and "q8" in held_weights(draft.model)


def choice(decided: DraftForm) -> tuple[str, str]:
    return decided.form, decided.reason


def test_choose_draft_form_keeps_quantized_unless_dequantized_is_clearly_cheaper():
    curve = VerifyCost({1: 1.0}, 0.001)
    costs = {"quantized": DraftCost(0.33, curve), "dequantized": DraftCost(0.21, curve)}
    assert choose_draft_form(costs).form == "dequantized"
    costs["dequantized"] = DraftCost(0.30, curve)
    assert choose_draft_form(costs).form == "quantized"
    alone = choose_draft_form({"quantized": costs["quantized"]}, "does not fit")
    assert choice(alone) == ("quantized", "quantized kept (does not fit)")
    assert DraftForm.from_json(alone.to_json()) == alone
