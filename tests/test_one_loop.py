"""One round loop: `Engine.stream` is the scheduler's batch of one, on the engine's own
target (`SingleCaches`), with everything the single sequence did before (trees, heads'
hidden states, the kept policy, each round priced for the run record)."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from lossless import assert_lossless, plain_greedy
from test_lossless import CPU_LIKE_COST
from tiny_models import VOCAB, byte_tokenizer, tiny_model

from mlxspec.batch.rows import as_list
from mlxspec.batch.scheduler import Scheduler
from mlxspec.decoding.engine import Engine, GenerationSettings
from mlxspec.drafter.head import HeadSpec, build_head
from mlxspec.events import Done, Step
from mlxspec.models.target import Target
from mlxspec.proposers import PromptLookup
from mlxspec.proposers.head import HeadProposer

EOS = set(byte_tokenizer().eos_token_ids)


def repeating_prompt(seed: int) -> list[int]:
    """Random bytes said twice: prompt lookup's drafts from the first half get accepted."""
    rng = random.Random(seed)
    half = [rng.randrange(1, 256) for _ in range(24)]
    return half + half[:12]


def engine_with(model, *proposers) -> Engine:
    engine = Engine(model, byte_tokenizer(), "tiny", verify_cost=CPU_LIKE_COST)
    for proposer in proposers:
        engine.add_proposer(proposer)
    return engine


def test_a_change_to_the_shared_round_changes_the_engine_and_the_batch(monkeypatch):
    """Refuse every draft inside the scheduler's round: if `Engine.stream` ran a loop of
    its own, it would still accept drafts."""
    model = tiny_model("llama", seed=1)
    settings = GenerationSettings(max_tokens=24, k=4)
    prompts = [repeating_prompt(seed) for seed in (1, 2)]

    def accepted(engine: Engine) -> tuple[int, int]:
        alone = list(engine.stream(prompts[0], settings, "lookup"))[-1].record.accepted
        batch = Scheduler(engine, max_batch=2)
        ids = [batch.submit(prompt, settings, "lookup") for prompt in prompts]
        done = {i: e for out in batch.drain() for i, es in out.items() for e in es}
        assert all(isinstance(done[i], Done) for i in ids)
        return alone, sum(done[i].record.accepted for i in ids)

    lookup = PromptLookup("lookup", ngram_max=3, ngram_min=1, k_max=4)
    assert min(accepted(engine_with(model, lookup))) > 0

    def refusing(self, slot, r, processed, reads):
        return [], as_list(reads["argmax"])[0]  # the target's own token

    monkeypatch.setattr(Scheduler, "_accept", refusing)
    lookup = PromptLookup("lookup", ngram_max=3, ngram_min=1, k_max=4)
    assert accepted(engine_with(model, lookup)) == (0, 0)


def test_every_round_of_a_stream_is_one_scheduler_round(monkeypatch):
    rounds = []
    original = Scheduler._round

    def counted(self) -> None:
        rounds.append(self.solo)
        original(self)

    monkeypatch.setattr(Scheduler, "_round", counted)
    engine = engine_with(tiny_model("qwen3", seed=2))
    events = list(engine.stream(repeating_prompt(3), GenerationSettings(max_tokens=12)))
    assert rounds == [True] * sum(isinstance(e, Step) for e in events) and rounds


@pytest.fixture(scope="module")
def head_engine():
    """A tiny llama and an untrained one-layer head on it (its drafts are nearly all
    refused, but it drafts only from the target's hidden states)."""
    model = tiny_model("llama", seed=3)
    spec = HeadSpec(hidden_size=64, vocab_size=VOCAB, final_norm=True, feed_normed=True, layers=1)
    mx.random.seed(0)
    head = build_head(spec, model, mx.arange(VOCAB))
    engine = engine_with(model)
    engine.add_proposer(HeadProposer(head, engine.target, k_max=4))
    return model, engine


def test_a_head_gets_the_hidden_states_of_exactly_the_tokens_its_round_added(
    head_engine, monkeypatch
):
    """Every round's (and the final `observe`'s) hidden rows are the target's own states
    of the tokens the cache took in since the last round, as one fresh pass computes them."""
    model, engine = head_engine
    proposer = engine.proposers["head"]
    seen = []  # (tokens, hidden) as each round's context had them

    def spy(original):
        def wrapped(ctx, *args):
            seen.append((list(ctx.tokens), ctx.hidden))
            return original(ctx, *args)

        return wrapped

    monkeypatch.setattr(proposer, "situation", spy(proposer.situation))
    monkeypatch.setattr(proposer, "observe", spy(proposer.observe))
    prompt = repeating_prompt(4)
    done = list(engine.stream(prompt, GenerationSettings(max_tokens=20, k=3), "head"))[-1]
    assert done.record.drafted > 0 and done.record.tree is False
    assert_lossless(model, prompt, plain_greedy(model, prompt, 20, EOS), [*done.token_ids], "")
    reference = Target(model)
    _, states = reference.fill(seen[-1][0][:-1], capture=())
    covered = 0
    for tokens, hidden in seen:
        start = len(tokens) - 1 - hidden.shape[0]
        assert start == covered  # no row missed, none twice
        assert mx.allclose(hidden, states[start : len(tokens) - 1], atol=1e-4)
        covered = len(tokens) - 1
    produced = [*prompt, *done.token_ids]
    assert seen[-1][0][: len(produced)] == produced  # the last is `observe`, after the last round


def test_a_tree_request_alone_verifies_trees_and_prices_every_round(head_engine):
    model, engine = head_engine
    prompt = repeating_prompt(5)
    settings = GenerationSettings(max_tokens=20, k=3, tree=True)
    events = list(engine.stream(prompt, settings, "head"))
    record = events[-1].record
    assert record.tree and record.tree_rounds > 0 and record.tree_nodes > record.tree_rounds
    steps = [e for e in events if isinstance(e, Step)]
    assert all(s.plain_steps != 1.0 for s in steps if s.drafted)  # priced on its own pass
    assert record.speedup_estimate.tokens == len(events[-1].token_ids) > 0  # every round priced
    assert record.batch_sizes == []  # not a batch's row
    reference = plain_greedy(model, prompt, 20, EOS)
    assert_lossless(model, prompt, reference, [*events[-1].token_ids], "tree", record)


@pytest.mark.parametrize("family", ["llama", "lfm2", "gemma3_text"])
def test_a_prefill_evaluates_the_cache_and_never_the_logits(monkeypatch, family):
    """`Target.fill` needs only the cache; evaluating the logits of every prompt position
    (the LM head, 9 % of a 500-token SmolLM2 prefill) was wasted work before every answer.
    mlx computes only what is evaluated, so no logits may reach `mx.eval` in a fill."""
    model = tiny_model(family)
    evaluated = []
    real_eval = mx.eval

    def spy(*arrays):
        leaves = []

        def walk(item):
            if isinstance(item, mx.array):
                leaves.append(item.shape)
            elif isinstance(item, (list, tuple)):
                for part in item:
                    walk(part)

        walk(arrays)
        evaluated.extend(leaves)
        return real_eval(*arrays)

    target = Target(model)
    prompt = repeating_prompt(1) * 3
    monkeypatch.setattr(mx, "eval", spy)
    target.fill(prompt)
    monkeypatch.setattr(mx, "eval", real_eval)
    assert evaluated and all(shape[-1] != VOCAB for shape in evaluated)
    # and the cache holds the prompt: the next step's logits are plain decoding's
    logits, _ = target.forward([7])
    reference = model(mx.array([[*prompt, 7]]))[0, -1]
    assert mx.allclose(logits[-1], reference, atol=1e-4)


def test_the_engine_is_what_the_scheduler_asks_of_its_owner():
    """The scheduler types its owner by `RoundOwner` rather than importing the engine (no
    import circle); the engine must still hold everything that protocol names."""
    from mlxspec.batch.owner import RoundOwner

    engine = engine_with(tiny_model())
    asked = set(RoundOwner.__annotations__) | {
        name for name in vars(RoundOwner) if not name.startswith("_")
    }
    missing = sorted(name for name in asked if not hasattr(engine, name))
    assert not missing, f"Engine lacks what RoundOwner names: {missing}"
