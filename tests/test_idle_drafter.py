"""A drafter that is off costs nothing: a draft model does no pass while its policy drafts
k = 0, and when drafting resumes it takes in every token the target accepted meanwhile
in one pass; the policy prices that pass, and the run record shows the drafter's time."""

from __future__ import annotations

import mlx.core as mx
import pytest
from lossless import assert_lossless, plain_greedy
from tiny_models import VOCAB, byte_tokenizer, tiny_model

from mlxspec.decoding.draft_cost import DraftCost
from mlxspec.decoding.engine import Engine, GenerationSettings
from mlxspec.decoding.policy import Policy
from mlxspec.decoding.verify_cost import VerifyCost
from mlxspec.drafter.head import HeadSpec, build_head
from mlxspec.events import Done
from mlxspec.models.prompt_cache import common_prefix
from mlxspec.proposers import DraftModel, Situation, truncated_model
from mlxspec.proposers.head import HeadProposer

CPU_LIKE_COST = VerifyCost({1: 1.0, 2: 1.13, 4: 1.39, 8: 1.55, 16: 2.05, 32: 3.22, 64: 5.71}, 0.05)
# Long stretches off, then drafting again: catch-ups of many tokens, and of a few.
SCRIPT = [3, 0, 0, 0, 0, 0, 0, 2, 0, 4, 4, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 3]


class ScriptedPolicy(Policy):
    """Drafts the k of its script, round by round (cycling): on and off on purpose."""

    def choose_among(self, situations, limit):
        k = SCRIPT[self.rounds % len(SCRIPT)]
        self.rounds += 1
        return (situations[0] if situations else None), min(k, limit)


def scripted(engine: Engine) -> None:
    def policy(proposer, fixed_k):
        made = ScriptedPolicy(engine.verify_cost)
        made.rounds = 0
        return made

    engine.kept_policy = policy


class CountingModel:
    """A draft model that logs the width of every pass it runs."""

    def __init__(self, model):
        self.model, self.passes = model, []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, inputs, cache=None):
        self.passes.append(inputs.shape[1])
        return self.model(inputs, cache=cache)


class Watched(DraftModel):
    """Records, for each `propose`, the passes it ran and what its cache was behind by."""

    def __init__(self, model, **kw):
        super().__init__(CountingModel(model), **kw)
        self.proposals: list[tuple[int, int, list[int]]] = []  # (k, behind, passes)
        self.fed: list[int] = []  # what the cache holds, as this test tracks it

    def propose(self, ctx, k):
        before = len(self.model.passes)
        # Everything after the common prefix is fed (the pending token always is).
        behind = len(ctx.tokens) - common_prefix(self.fed, ctx.tokens[:-1])
        draft = super().propose(ctx, k)
        self.fed = [*ctx.tokens, *draft.tokens[: k - 1]]
        self.proposals.append((k, behind, self.model.passes[before:]))
        return draft


def engine_with(family: str, draft: DraftModel) -> tuple[Engine, object]:
    model = tiny_model(family, seed=0)
    engine = Engine(model, byte_tokenizer(), family, verify_cost=CPU_LIKE_COST)
    engine.add_proposer(draft)
    scripted(engine)
    return engine, model


def generate(engine: Engine, prompt: list[int], proposer: str, tokens: int = 60) -> Done:
    done = list(engine.stream(prompt, GenerationSettings(max_tokens=tokens), proposer))[-1]
    assert isinstance(done, Done)
    return done


def test_draft_model_runs_no_pass_while_off_and_catches_up_in_one():
    draft = Watched(tiny_model("llama", seed=99), name="draft", k_max=4)
    engine, _ = engine_with("llama", draft)
    prompt = list(b"the cat sat on the mat, the cat sat on")
    done = generate(engine, prompt, "draft")
    drafting_rounds = sum(1 for k in SCRIPT if k) * done.record.verify_steps // len(SCRIPT)
    assert len(draft.proposals) >= drafting_rounds >= 3
    # Every pass ran inside a drafting round: none while k = 0.
    assert sum(len(passes) for _, _, passes in draft.proposals) == len(draft.model.passes)
    resumed_after_pause = 0
    for k, behind, passes in draft.proposals:
        assert k > 0
        # One pass over exactly what was missed, then a step per further draft token.
        assert passes == [behind] + [1] * (k - 1), (k, behind, passes)
        resumed_after_pause += behind > 4
    assert resumed_after_pause >= 2  # the script's pauses made real catch-ups
    assert done.record.drafter_seconds > 0


def test_drafter_off_all_answer_costs_no_time_and_no_pass():
    draft = Watched(tiny_model("llama", seed=99), name="draft", k_max=4)
    engine, _ = engine_with("llama", draft)
    engine.kept_policy = lambda proposer, fixed_k: Policy(CPU_LIKE_COST, fixed_k=0)
    done = generate(engine, list(b"hello there, hello"), "draft", tokens=30)
    assert done.record.completion_tokens == 30
    assert draft.model.passes == []
    assert done.record.drafted == 0
    assert done.record.drafter_seconds < 0.01  # only the scheduler's bookkeeping


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "lfm2"])
def test_greedy_equals_plain_while_the_draft_model_turns_on_and_off(family):
    """KV, a rotating window (gemma3's 12 columns: catch-ups wider than it) and recurrent
    state (lfm2: no trim, so a catch-up starts over)."""
    tokenizer = byte_tokenizer()
    draft = DraftModel(tiny_model(family, seed=99), name="draft", k_max=4)
    engine, model = engine_with(family, draft)
    engine.add_proposer(DraftModel(truncated_model(model, 2), name="truncated", k_max=4))
    for prompt in (list(b"one two three one two"), list(b"def f(x):\n    return x + 1\n")):
        reference = plain_greedy(model, prompt, 48, set(tokenizer.eos_token_ids))
        for name in ("draft", "truncated"):
            done = generate(engine, prompt, name, tokens=48)
            label = f"{family} {name} {bytes(prompt)!r}"
            assert_lossless(model, prompt, reference, list(done.token_ids), label, done.record)
            assert done.record.drafted > 0, label


class CountingHead:
    """A drafter head that logs the width of every pass it runs."""

    def __init__(self, head):
        self.head, self.passes = head, []

    def __getattr__(self, name):
        return getattr(self.head, name)

    def __call__(self, hidden, embeds, mask, cache):
        self.passes.append(hidden.shape[1])
        return self.head(hidden, embeds, mask, cache)


class WatchedHead(HeadProposer):
    """Records, for each `propose`, its k, the catch-up its situation told, its passes."""

    def situation(self, ctx):
        self.told = super().situation(ctx)
        return self.told

    def propose(self, ctx, k):
        before = len(self.head.passes)
        draft = super().propose(ctx, k)
        self.proposals.append((k, self.told.catch_up, self.head.passes[before:]))
        return draft


def test_a_head_runs_no_pass_while_off_and_catches_up_on_the_rows_it_missed():
    model = tiny_model("llama", seed=0)
    engine = Engine(model, byte_tokenizer(), "llama", verify_cost=CPU_LIKE_COST)
    spec = HeadSpec(hidden_size=64, vocab_size=VOCAB, final_norm=True, feed_normed=True)
    proposer = WatchedHead(build_head(spec, model, mx.arange(VOCAB)), engine.target, k_max=4)
    proposer.head, proposer.proposals = CountingHead(proposer.head), []
    engine.add_proposer(proposer)
    scripted(engine)
    generate(engine, list(b"the cat sat on the mat, the cat sat on"), "head")
    assert len(proposer.proposals) >= 3
    assert sum(len(p) for _, _, p in proposer.proposals) == len(proposer.head.passes)
    for k, behind, passes in proposer.proposals:
        assert passes == [behind] + [1] * (k - 1), (k, behind, passes)
    assert sum(behind > 4 for _, behind, _ in proposer.proposals) >= 2


class Stateful:
    name, k_max, needs_hidden, cost_hint = "stateful", 8, False, 0.1
    own_cost = None


def test_policy_prices_the_catch_up_pass_of_a_drafter_that_was_off():
    """At 0.7 acceptance and a tenth of a step per draft token, drafting pays in step. A
    drafter 200 tokens behind pays a catch-up of verify(200) draft steps once, which each
    token the request has left bears a share of: with 8 left drafting does not pay (the
    pass costs more than the round saves), with 10,000 left it resumes at once."""
    policy = Policy(CPU_LIKE_COST)
    source = Stateful()
    policy.update(Situation(source, "warm-up"), 1, 1, 0.005)  # proven: it drafted (0.1 steps)
    in_step = Situation(source, "model", prior=0.7, catch_up=1)
    behind = Situation(source, "model", prior=0.7, catch_up=200)
    k_in_step, speed_in_step = policy._plan(in_step, 8, 10_000)
    assert k_in_step > 0
    price = policy._catch_up_price(behind, 0.1)
    assert price == pytest.approx((CPU_LIKE_COST(200) - 1.0) * 0.1)
    k_short, speed_short = policy._plan(behind, 8, 8)
    assert speed_short < speed_in_step
    made = (1 - 0.7 ** (k_short + 1)) / 0.3
    cost = CPU_LIKE_COST(k_short + 1) + 0.1 * k_short + price * made / 8
    assert speed_short == pytest.approx(max(1.0, made / cost))
    k_long, speed_long = policy._plan(behind, 8, 10_000)
    assert k_long == k_in_step and speed_long == pytest.approx(speed_in_step, rel=0.01)


def test_an_unproven_drafter_behind_the_prompt_starts_only_where_it_would_pay_when_often_wrong():
    """Before a drafter has drafted, its first catch-up (the whole prompt) is paid blind:
    priced at UNPROVEN_ACCEPTANCE at most, a dear draft (0.4 of a step, SmolLM2's own 10
    layers here) waits for its priced probe while a cheap one (a 0.5B beside a 7B on a Mac)
    starts at once; once it has drafted, what it showed decides."""
    policy = Policy(CPU_LIKE_COST)
    dear, cheap = Stateful(), Stateful()
    dear.cost_hint, cheap.cost_hint, cheap.name = 0.4, 0.05, "cheap"
    for source, starts in ((dear, False), (cheap, True)):
        behind = Situation(source, "model", prior=0.7, catch_up=100)
        assert (policy._plan(behind, 8, 10_000)[0] > 0) == starts
    policy.update(Situation(dear, "model", prior=0.7), 2, 2, 0.04)  # drafted, both kept
    assert policy._plan(Situation(dear, "model", prior=0.7, catch_up=100), 8, 10_000)[0] > 0


def test_a_catch_up_is_not_taken_for_the_price_of_a_draft_token():
    """A round that caught up 64 tokens and drafted 1: its pass cost verify(64) draft steps
    of 0.1 target steps, of which one is the draft token's; the rest is the catch-up's."""
    policy = Policy(CPU_LIKE_COST)
    policy.step_seconds = 1.0
    source = Stateful()
    units = CPU_LIKE_COST(64) - 1.0
    policy.update(Situation(source, "model", catch_up=64), 1, 1, draft_seconds=0.1 * (1 + units))
    assert policy.draft_cost["stateful"] == pytest.approx(0.1)


def test_a_measured_draft_step_prices_a_draft_token_before_any_was_timed():
    policy = Policy(CPU_LIKE_COST)  # target step: 0.05 s
    source = Stateful()
    source.own_cost = DraftCost(0.05, VerifyCost({1: 1.0, 8: 1.2}, step_seconds=0.0025))
    assert policy.draft_price(source) == pytest.approx(0.05)
    assert policy._catch_up_units(Situation(source, "model", catch_up=8)) == pytest.approx(0.2)
