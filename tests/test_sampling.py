"""Rejection sampling reproduces the target's distribution (chi-square, fixed seeds)."""

from __future__ import annotations

from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from tiny_models import byte_tokenizer, tiny_model

from mlxspec.decoding.engine import Engine, GenerationSettings
from mlxspec.decoding.verify_cost import VerifyCost
from mlxspec.proposers import DraftModel, truncated_model
from mlxspec.sampling import SamplingSettings, TokenScorer, rejection_sample, sample_from, top_two

# Target rows p0, p1, p2 and an adversarial draft q: heavy where p is light.
P = np.array(
    [
        [0.40, 0.25, 0.15, 0.10, 0.07, 0.03],
        [0.05, 0.05, 0.10, 0.20, 0.25, 0.35],
        [0.30, 0.30, 0.10, 0.10, 0.10, 0.10],
    ]
)
Q = np.array([[0.02, 0.03, 0.05, 0.10, 0.30, 0.50], [0.50, 0.30, 0.10, 0.05, 0.03, 0.02]])
TRIALS = 40_000
CRITICAL_DF5 = 20.52  # chi-square, 5 degrees of freedom, alpha = 0.001


def chi_square(counts: Counter, probs: np.ndarray) -> float:
    total = sum(counts.values())
    observed = np.array([counts.get(i, 0) for i in range(len(probs))])
    expected = probs * total
    return float(((observed - expected) ** 2 / expected).sum())


def significant(statistic: float, dof: int, z: float = 3.72) -> bool:
    """Beyond what chance gives at alpha 1e-4 (z: its normal quantile). Wilson-Hilferty's
    chi-square quantile errs by <7%, on the safe side, down to 1 dof; dof + 4.5 sqrt(2 dof)
    would flag one run in ~500 at 4 dof. With 0 dof (one category) nothing can differ."""
    if dof < 1:
        return False
    h = 2 / (9 * dof)
    return statistic >= dof * (1 - h + z * np.sqrt(h)) ** 3


def simulate(rule, one_hot: bool = False, seed: int = 0):
    """First, second (when the first draft was accepted) and bonus (after both drafts
    were accepted: drawn from the row after the last draft) emitted tokens."""
    rng = np.random.default_rng(seed)
    first, second, bonus = Counter(), Counter(), Counter()
    for _ in range(TRIALS):
        if one_hot:
            drafts, q = [4, 5], None  # a lookup draft: fixed tokens
        else:
            drafts, q = [sample_from(Q[0], rng), sample_from(Q[1], rng)], Q
        n, own = rule(drafts, q, P, rng)
        emitted = [*drafts[:n], own]
        first[emitted[0]] += 1
        if n >= 1:
            second[emitted[1]] += 1
        if n == len(drafts):
            bonus[emitted[2]] += 1
    return first, second, bonus


def broken_rule(drafts, q, p, rng):
    """A plausible bug: resample from p instead of norm(max(0, p - q)) after a rejection."""
    for i, token in enumerate(drafts):
        q_token = 1.0 if q is None else q[i, token]
        if rng.random() * q_token < p[i, token]:
            continue
        return i, sample_from(p[i], rng)
    return len(drafts), sample_from(p[len(drafts)], rng)


def test_rejection_sampling_matches_target_distribution_with_adversarial_draft():
    first, second, _ = simulate(rejection_sample)
    assert chi_square(first, P[0]) < CRITICAL_DF5
    assert chi_square(second, P[1]) < CRITICAL_DF5


def test_rejection_sampling_matches_target_distribution_with_one_hot_draft():
    first, second, _ = simulate(rejection_sample, one_hot=True)
    assert chi_square(first, P[0]) < CRITICAL_DF5
    assert chi_square(second, P[1]) < CRITICAL_DF5


@pytest.mark.parametrize("one_hot", [False, True], ids=["drafter-q", "one-hot"])
def test_the_bonus_after_a_full_accept_follows_the_row_after_the_last_draft(one_hot):
    _, _, bonus = simulate(rejection_sample, one_hot=one_hot)
    assert sum(bonus.values()) >= 500, "too few full accepts to test the bonus"
    assert chi_square(bonus, P[2]) < CRITICAL_DF5


def test_the_chi_square_check_catches_a_broken_accept_rule():
    first, _, _ = simulate(broken_rule)
    assert chi_square(first, P[0]) > 10 * CRITICAL_DF5


def two_sample_chi_square(a: Counter, b: Counter, min_count: int = 10) -> tuple[float, int]:
    """Homogeneity chi-square; rare categories are pooled. Returns (statistic, dof)."""
    keys = [key for key in set(a) | set(b) if a[key] + b[key] >= min_count]
    rows_a = [a[key] for key in keys] + [sum(a.values()) - sum(a[key] for key in keys)]
    rows_b = [b[key] for key in keys] + [sum(b.values()) - sum(b[key] for key in keys)]
    table = np.array([rows_a, rows_b], dtype=float)
    table = table[:, table.sum(axis=0) > 0]
    expected = table.sum(axis=1, keepdims=True) * table.sum(axis=0) / table.sum()
    return float(((table - expected) ** 2 / expected).sum()), table.shape[1] - 1


class Flattened:
    """A model whose logits are scaled: the same ranking, a flatter distribution."""

    def __init__(self, model, scale: float):
        self.model, self.scale = model, scale
        self.layers = model.layers

    def __call__(self, inputs, cache=None):
        return self.model(inputs, cache=cache) * self.scale


def test_engine_sampling_with_a_draft_model_matches_the_target():
    """End to end: the first token, and the first two together, against the target's exact
    laws (a one-sample chi-square each: sharper than comparing with as many mlx-lm runs,
    whose own sampling noise the test used to carry, and half the time)."""
    tokenizer = byte_tokenizer()
    model = tiny_model("llama", seed=5, sharpness=8.0)
    # The draft is the target flattened (q ~ p^0.35): q overlaps p but over-weights its
    # tail, which is where a wrong rejection rule shows (a disjoint q would hide it).
    draft = DraftModel(Flattened(tiny_model("llama", seed=5, sharpness=8.0), 0.35), k_max=3)
    engine = Engine(model, tokenizer, "llama", [draft], verify_cost=VerifyCost({1: 1.0}, 1.0))
    prompt = [40, 41, 42, 43]
    runs = 800  # the first-token check's power against `broken_rule`: ~0.97 (0.65 at 400)
    spec_first, spec_pairs = Counter(), Counter()
    for seed in range(runs):
        settings = GenerationSettings(
            max_tokens=2, k=2, sampling=SamplingSettings(temperature=1.0, seed=seed)
        )
        done = list(engine.stream(prompt, settings, "draft-model"))[-1]
        assert done.record.drafted == 1
        spec_first[done.token_ids[0]] += 1
        spec_pairs[done.token_ids] += 1

    first = np.array(mx.softmax(model(mx.array([prompt]))[0, -1].astype(mx.float32)))
    statistic, dof = one_sample_chi_square(spec_first, first)
    assert dof >= 3, "the test model is too confident to test anything"
    assert not significant(statistic, dof), ("first token", statistic, dof)
    # The pair law p(a) p(b | a), every a in one batched pass; pairs as ids a * V + b.
    vocab = len(first)
    after = mx.array([prompt + [a] for a in range(vocab)])
    second = np.array(mx.softmax(model(after)[:, -1].astype(mx.float32), axis=-1))
    pairs = Counter({a * vocab + b: n for (a, b), n in spec_pairs.items()})
    statistic, dof = one_sample_chi_square(pairs, (first[:, None] * second).reshape(-1))
    assert not significant(statistic, dof), ("first two", statistic, dof)


def one_sample_chi_square(seen: Counter, law: np.ndarray) -> tuple[float, int]:
    """`seen` (draws by token id) against `law`: the ids expected at least 5 times and
    the rest pooled. Returns (statistic, dof)."""
    runs = sum(seen.values())
    likely = [t for t in range(len(law)) if law[t] * runs >= 5]
    observed = np.array([seen[t] for t in likely] + [runs - sum(seen[t] for t in likely)])
    expected = np.array([law[t] for t in likely] + [1 - law[likely].sum()]) * runs
    return float(((observed - expected) ** 2 / expected).sum()), len(observed) - 1


def test_a_fixed_seed_reproduces_a_sampled_run():
    tokenizer = byte_tokenizer()
    model = tiny_model("llama", seed=6, sharpness=4.0)
    engine = Engine(
        model,
        tokenizer,
        "llama",
        [DraftModel(truncated_model(model, 1))],
        verify_cost=VerifyCost({1: 1.0}, 1.0),
    )

    def sample(seed):
        settings = GenerationSettings(
            max_tokens=20, k=3, sampling=SamplingSettings(temperature=0.8, seed=seed)
        )
        return list(engine.stream([1, 2, 3], settings, "draft-model"))[-1].token_ids

    assert sample(11) == sample(11)
    assert sample(11) != sample(12)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_top_two_gives_what_topk_gives_ties_included(dtype):
    """The near-tie test reads each row's best two logits without `mx.topk`: the same
    values, a repeated maximum (an exact tie) included, and the same near ties."""
    rows = mx.array(np.random.default_rng(0).normal(size=(6, 50)) * 4, dtype)
    rows[1, 7] = rows[1, 30] = 20.0  # the maximum twice: a tie of gap 0
    rows[2, 3], rows[2, 9] = 20.0, 20.0005  # a near tie
    rows[3, :] = -5.0  # one value everywhere
    best = mx.argmax(rows, axis=-1)
    top = mx.sort(mx.topk(rows, 2, axis=-1), axis=-1)[:, ::-1]
    assert mx.array_equal(top_two(rows, best), top).item()
    scorer = TokenScorer(SamplingSettings())
    assert scorer.near_tie_rows(rows, best).tolist() == scorer.near_tie_rows(rows).tolist()
    assert scorer.near_tie_rows(rows).tolist()[1:4] == [True, True, True]
