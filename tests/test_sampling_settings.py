"""Sampling settings during speculation: the engine's output must be what plain mlx-lm
decoding gives with the same settings (repetition, presence and frequency penalties,
top-p, top-k, temperature).

Greedy runs are compared token for token with mlx-lm's `generate_step`; sampled runs by
two-sample chi-squares against `generate_step` with `make_sampler`, on the first four
tokens of seeded runs with k = 3, so that rejections at every draft position and bonus
tokens after full accepts all take part.
"""

from __future__ import annotations

import bisect
import warnings
from collections import Counter
from dataclasses import dataclass, replace
from functools import cache

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors, make_sampler
from test_lossless import CPU_LIKE_COST, prompts_for
from test_sampling import Flattened, broken_rule, significant, two_sample_chi_square
from test_trees import resample_from_p
from tiny_models import byte_tokenizer, tiny_model

import mlxspec.decoding.request
from mlxspec.decoding.engine import Engine, GenerationSettings
from mlxspec.decoding.verify_cost import VerifyCost
from mlxspec.events import Bonus, Rejected, TokenEvent
from mlxspec.proposers import (
    Draft,
    DraftModel,
    PromptLookup,
    ProposalContext,
    Situation,
    truncated_model,
)
from mlxspec.sampling import NEAR_TIE, SamplingSettings, TokenScorer, rejection_sample, sample_from

EOS = set(byte_tokenizer().eos_token_ids)


def logits_processors(sampling: SamplingSettings) -> list:
    """mlx-lm's processors for the settings, field by field (not through TokenScorer)."""
    return make_logits_processors(
        repetition_penalty=sampling.repetition_penalty,
        repetition_context_size=sampling.repetition_context_size,
        presence_penalty=sampling.presence_penalty,
        presence_context_size=sampling.presence_context_size,
        frequency_penalty=sampling.frequency_penalty,
        frequency_context_size=sampling.frequency_context_size,
    )


def mlx_lm_tokens(model, prompt: list[int], max_tokens: int, sampling: SamplingSettings):
    """What plain mlx-lm decoding emits with these settings (EOS excluded, as the engine)."""
    sampler = make_sampler(sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)
    processors = logits_processors(sampling)
    if sampling.seed is not None:
        mx.random.seed(sampling.seed)
    steps = generate_step(
        mx.array(prompt),
        model,
        max_tokens=max_tokens,
        sampler=sampler,
        logits_processors=processors,
    )
    out = []
    for token, _ in steps:
        if int(token) in EOS:
            break
        out.append(int(token))
    return tuple(out)


# --- Greedy with penalties: token for token -------------------------------------------------

PENALTIES = {
    "penalty-1.5": SamplingSettings(repetition_penalty=1.5),
    "penalty-1.3-last-6": SamplingSettings(repetition_penalty=1.3, repetition_context_size=6),
    # Unequal windows: each penalty must count over its own.
    "presence-frequency": SamplingSettings(
        presence_penalty=1.5, presence_context_size=12, frequency_penalty=0.8
    ),
}


def processed_top2_gap(model, tokens: list[int], sampling: SamplingSettings) -> float:
    """The near-tie measure of tests/lossless.py, on the logits after the processors."""
    logits = model(mx.array([tokens]))[:, -1, :]
    for processor in logits_processors(sampling):
        logits = processor(mx.array(tokens), logits)
    top = mx.sort(logits[0])[-2:].tolist()
    return top[1] - top[0]


def assert_same_greedy(model, prompt, reference, got, sampling, label: str) -> None:
    if got == reference:
        return
    first = next((i for i, (a, b) in enumerate(zip(got, reference)) if a != b), None)
    first = min(len(got), len(reference)) if first is None else first
    gap = processed_top2_gap(model, prompt + list(reference[:first]), sampling)
    assert gap < NEAR_TIE, (
        f"{label}: diverges from mlx-lm at token {first} (processed top-2 gap {gap:.2e})\n"
        f"  mlx-lm: {reference[max(0, first - 3) : first + 3]}\n"
        f"  engine: {got[max(0, first - 3) : first + 3]}"
    )
    warnings.warn(f"tolerated near tie: {label} at token {first}, gap {gap:.2e}", stacklevel=2)


# What a penalty reads (token ids, the rows' prefixes) is the same in both families: one
# runs the presence and frequency penalties (each run is ~5 s).
GREEDY_CASES = [(family, name) for family in ("llama", "qwen3") for name in PENALTIES]
GREEDY_CASES.remove(("qwen3", "presence-frequency"))


@pytest.mark.parametrize("family, name", GREEDY_CASES)
def test_greedy_with_a_penalty_matches_mlx_lm(family, name):
    """Every draft row must see the penalty of its own prefix (a line's drafts, a tree
    node's path): lines and trees, lookup and a draft model, fixed and adaptive k."""
    sampling = PENALTIES[name]
    model = tiny_model(family, seed=1)
    engine = Engine(model, byte_tokenizer(), family, verify_cost=CPU_LIKE_COST)
    engine.add_proposer(PromptLookup("lookup", ngram_max=3, ngram_min=1, k_max=8))
    engine.add_proposer(DraftModel(truncated_model(model, 2), name="draft", k_max=5))
    drafted = accepted = tree_rounds = penalised = 0
    for prompt in prompts_for(2):
        reference = mlx_lm_tokens(model, prompt, 40, sampling)
        penalised += reference != mlx_lm_tokens(model, prompt, 40, SamplingSettings())
        for name in engine.proposers:
            for tree in (False, True):
                for k in (3, None):
                    settings = GenerationSettings(max_tokens=40, k=k, tree=tree, sampling=sampling)
                    done = list(engine.stream(prompt, settings, name))[-1]
                    label = f"{family} {name} tree={tree} k={k} prompt={prompt[:4]}..."
                    assert_same_greedy(model, prompt, reference, done.token_ids, sampling, label)
                    drafted += done.record.drafted
                    accepted += done.record.accepted
                    tree_rounds += done.record.tree_rounds
    assert penalised >= 2, "the penalty hardly changes the output: ignoring it would pass"
    assert 0 < accepted < drafted and tree_rounds > 0


# --- Sampled: top-p, top-k, temperature, penalty; lines and trees ---------------------------

PROMPT = [40, 41, 42, 43]
MAX_TOKENS, K = 4, 3  # the first round drafts 3: rejections at 0, 1, 2 and bonuses after 3
RUNS = 200
RANK_BINS = (1, 2, 3, 5)  # a token's rank under the target: 1, 2, 3, 4-5, 6+
SAMPLED = {
    "temperature": SamplingSettings(temperature=1.0),
    # Temperatures other than 1 tell "top-p/top-k, then temperature" (mlx-lm's order)
    # from the other way round.
    "top-p": SamplingSettings(temperature=0.7, top_p=0.8),
    "top-k": SamplingSettings(temperature=1.5, top_k=6),
    "top-p-top-k-penalty": SamplingSettings(
        temperature=1.0, top_p=0.9, top_k=8, repetition_penalty=2.0, repetition_context_size=6
    ),
    # Negative: recent tokens boosted, so repeats are common and a row penalised over
    # another row's prefix shows (positive ones here hardly change the law of 4 tokens).
    "presence-frequency": SamplingSettings(
        temperature=0.8,
        presence_penalty=-2.0,
        presence_context_size=3,
        frequency_penalty=-1.0,
        frequency_context_size=6,
    ),
}


@dataclass
class Runs:
    """RUNS seeded runs of one setting: their tokens (EOS included where it ended one),
    the (run, position) of every bonus token, and how many rounds kept n drafts."""

    tokens: list[tuple[int, ...]]
    bonuses: list[tuple[int, int]]
    kept: Counter


class GreedyLine:
    """The drafter's likeliest line without its q (one-hot drafts, as prompt lookup's):
    the engine must then take the multi-candidate rule (sample_walk) on a line."""

    name, needs_hidden, cost_hint = "greedy-line", False, 0.0

    def __init__(self, drafter: DraftModel):
        self.drafter, self.k_max = drafter, drafter.k_max

    def situation(self, ctx: ProposalContext) -> Situation:
        return Situation(self, "greedy-line")

    def propose(self, ctx: ProposalContext, k: int) -> Draft:
        greedy = TokenScorer(replace(ctx.scorer.settings, temperature=0.0))
        return self.drafter.propose(replace(ctx, scorer=greedy), k)


# How a round drafts: (proposer, tree); the rounds' accepted lengths each must reach.
DRAFTING = {
    "line": ("draft-model", False, K + 1),  # drafts with q: rejection_sample
    "tree": ("draft-model", True, K),  # sample_walk over a tree (2 deep at most here)
    "one-hot-line": ("greedy-line", False, 2),  # sample_walk on a line, drafts of q=1
}


@cache
def sampled_engine() -> Engine:
    """A flat target (many tokens with mass) and its flattened self as the drafter: q
    overlaps p but over-weights its tail, where a wrong rejection rule shows. A flat
    verify cost keeps every node of a tree."""
    model = tiny_model("llama", seed=5, sharpness=5.0)
    draft = DraftModel(Flattened(model, 0.5), k_max=K)
    proposers = [draft, GreedyLine(draft)]
    return Engine(model, byte_tokenizer(), "llama", proposers, VerifyCost({1: 1.0, 64: 1.0}, 1.0))


def with_eos(tokens: tuple[int, ...]) -> tuple[int, ...]:
    return tokens if len(tokens) == MAX_TOKENS else (*tokens, *EOS)


@cache
def mlx_lm_runs(name: str) -> list[tuple[int, ...]]:
    model = sampled_engine().target.model
    return [
        with_eos(mlx_lm_tokens(model, PROMPT, MAX_TOKENS, replace(SAMPLED[name], seed=seed)))
        for seed in range(RUNS)
    ]


def engine_runs(name: str, drafting: str) -> Runs:
    engine, runs = sampled_engine(), Runs([], [], Counter())
    proposer, tree, _ = DRAFTING[drafting]
    for seed in range(RUNS):
        sampling = replace(SAMPLED[name], seed=seed)
        settings = GenerationSettings(max_tokens=MAX_TOKENS, k=K, tree=tree, sampling=sampling)
        events = list(engine.stream(PROMPT, settings, proposer))
        record = events[-1].record
        assert record.tree == tree and (record.tree_rounds > 0) == tree
        emitted = [(type(e), t) for e in events if isinstance(e, TokenEvent) for t in e.tokens]
        emitted = [(kind, token) for kind, token in emitted if kind is not Rejected]
        assert tuple(token for _, token in emitted) == events[-1].token_ids
        runs.bonuses += [(seed, i) for i, (kind, _) in enumerate(emitted) if kind is Bonus]
        runs.tokens.append(with_eos(events[-1].token_ids))
        runs.kept.update(dict(enumerate(record.accepted_lengths)))
    return runs


def target_rows(runs: list[tuple[int, ...]]) -> np.ndarray:
    """(runs, MAX_TOKENS, V): the target's plain (temperature 1) law of each token given
    its own prefix, in one batched forward (padding after a run's end changes nothing
    before it)."""
    padded = [PROMPT + list(run) + [0] * (MAX_TOKENS - len(run)) for run in runs]
    logits = sampled_engine().target.model(mx.array(padded))[:, len(PROMPT) - 1 : -1, :]
    return np.array(mx.softmax(logits.astype(mx.float32), axis=-1))


def rank_bin(row: np.ndarray, token: int) -> int:
    """Which of RANK_BINS the token's rank (1: the likeliest) falls in."""
    return bisect.bisect_left(RANK_BINS, 1 + int((row > row[token]).sum()))


def bin_probabilities(row: np.ndarray) -> np.ndarray:
    """The chance of each rank bin under a row."""
    ordered = np.sort(row)[::-1]
    edges = (0, *RANK_BINS, len(row))
    return np.array([ordered[a:b].sum() for a, b in zip(edges, edges[1:])])


def repeats(run: tuple[int, ...], window: int = 6) -> int:
    """How many of the run's tokens occur among the `window` tokens before them."""
    tokens = PROMPT + list(run)
    return sum(tokens[i] in tokens[max(0, i - window) : i] for i in range(len(PROMPT), len(tokens)))


def differences(spec_runs, plain_runs) -> list[str]:
    """The laws that differ between two sets of runs: at each position the token and its
    binned rank under the target ("end" after EOS), the first two tokens together, and
    how many tokens repeat a recent one (what a repetition penalty is about)."""
    spec_rows, plain_rows = target_rows(spec_runs), target_rows(plain_runs)
    laws = {"tokens 1-2": lambda run, rows: run[:2], "repeats": lambda run, rows: repeats(run)}
    for i in range(MAX_TOKENS):
        laws[f"token {i + 1}"] = lambda run, rows, i=i: run[i] if len(run) > i else "end"
        laws[f"rank of token {i + 1}"] = lambda run, rows, i=i: (
            rank_bin(rows[i], run[i]) if len(run) > i else "end"
        )
    found = []
    for label, law in laws.items():
        statistic, dof = two_sample_chi_square(
            Counter(map(law, spec_runs, spec_rows)), Counter(map(law, plain_runs, plain_rows))
        )
        if significant(statistic, dof):
            found.append(f"{label}: chi-square {statistic:.1f} on {dof} dof")
    return found


def departures_from_the_target(runs: Runs) -> list[str]:
    """Plain sampling (temperature 1) only: each token, given its own prefix, must be a
    draw from the target's row there, whatever was drafted, accepted or refused before.
    So at each position, and for the bonus tokens alone, the binned ranks observed must
    match the sum of the rows' bin chances (a one-sample chi-square, conservative for
    unequal rows): twice the power of a comparison with sampled runs."""
    rows = target_rows(runs.tokens)
    groups = {
        f"token {i + 1}": [(r, i) for r, run in enumerate(runs.tokens) if len(run) > i]
        for i in range(MAX_TOKENS)
    }
    groups["bonus tokens"] = runs.bonuses
    found = []
    for label, cells in groups.items():
        observed, expected = np.zeros(len(RANK_BINS) + 1), np.zeros(len(RANK_BINS) + 1)
        for run, position in cells:
            row = rows[run, position]
            observed[rank_bin(row, runs.tokens[run][position])] += 1
            expected += bin_probabilities(row)
        statistic = float(((observed - expected) ** 2 / expected).sum())
        if significant(statistic, len(observed) - 1):
            found.append(f"{label}: ranks {observed} for {expected.round(1)} expected")
    return found


def assert_every_outcome_happened(runs: Runs, drafting: str, at_least: int) -> None:
    """Rounds that kept each possible number of drafts: refusals at every position and,
    for lines with q, full accepts."""
    levels = DRAFTING[drafting][2]
    assert min(runs.kept[n] for n in range(levels)) >= at_least, runs.kept


@pytest.mark.parametrize("drafting", DRAFTING)
def test_sampled_speculation_follows_the_target_token_by_token(drafting):
    """k = 3 over 4 tokens: refusals at every draft position, bonuses after full accepts
    (for trees after paths of 2), each token checked against its exact law."""
    runs = engine_runs("temperature", drafting)
    departures = departures_from_the_target(runs)
    assert not departures, departures
    found = differences(runs.tokens, mlx_lm_runs("temperature"))
    assert not found, found
    assert_every_outcome_happened(runs, drafting, 20)
    assert len(runs.bonuses) >= 100


def bonus_from_the_last_draft_row(draft_tokens, draft_probs, target_probs, rng):
    """A plausible off-by-one: after a full accept, the bonus drawn from the row that
    judged the last draft instead of the row after it."""
    n, own = rejection_sample(draft_tokens, draft_probs, target_probs, rng)
    if n == len(draft_tokens) and n > 0:
        own = sample_from(target_probs[n - 1], rng)
    return n, own


@pytest.mark.parametrize(
    "name, broken, drafting",
    [
        ("rejection_sample", broken_rule, "line"),
        ("rejection_sample", bonus_from_the_last_draft_row, "line"),
        ("sample_walk", resample_from_p, "tree"),
        ("sample_walk", resample_from_p, "one-hot-line"),
    ],
    ids=["line-resamples-from-p", "line-bonus-from-the-wrong-row", "tree", "one-hot-line"],
)
def test_the_end_to_end_check_catches_a_wrong_acceptance_rule(monkeypatch, name, broken, drafting):
    monkeypatch.setattr(mlxspec.decoding.request, name, broken)
    assert departures_from_the_target(engine_runs("temperature", drafting))


SETTINGS_CASES = [("top-p", "line"), ("top-k", "tree")]
SETTINGS_CASES += [("top-p-top-k-penalty", drafting) for drafting in ("line", "tree")]
SETTINGS_CASES += [("presence-frequency", "line")]


@pytest.mark.parametrize("name, drafting", SETTINGS_CASES)
def test_sampling_settings_during_speculation_match_mlx_lm(name, drafting):
    """Top-p, top-k and the penalties through lines and trees: the law of the
    first four tokens equals mlx-lm's `make_sampler` + `generate_step` with them."""
    runs = engine_runs(name, drafting)
    found = differences(runs.tokens, mlx_lm_runs(name))
    assert not found, found
    assert_every_outcome_happened(runs, drafting, 10)
