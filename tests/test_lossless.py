"""Greedy speculative output == plain greedy output, for every proposer and cache kind."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from lossless import NEAR_TIE, assert_lossless, plain_greedy
from mlx_lm.models.cache import make_prompt_cache
from tiny_models import VOCAB, byte_tokenizer, tiny_model

from mlxspec.engine import Engine, GenerationSettings
from mlxspec.events import Done
from mlxspec.policy import VerifyCost
from mlxspec.proposers import (
    Draft,
    DraftModel,
    PromptLookup,
    SelfSpeculation,
    Situation,
    truncated_model,
)

FAMILIES = ["llama", "qwen3", "gemma3_text", "lfm2"]
MAX_TOKENS = 40
# A cost curve like the one measured on this CPU, so the adaptive policy drafts.
CPU_LIKE_COST = VerifyCost({1: 1.0, 2: 1.13, 4: 1.39, 8: 1.55, 16: 2.05, 32: 3.22, 64: 5.71}, 0.05)


class Oracle:
    """Drafts the known plain output, corrupting one draft position per round.

    The corrupted position cycles through 0..k-1, so rejections (and cache rollback)
    happen at every position of the draft; some rounds draft it uncorrupted.
    """

    needs_hidden = False
    cost_hint = 0.0

    def __init__(self, prompt_len: int, reference: list[int], name: str = "oracle", k_max=6):
        self.name, self.k_max = name, k_max
        self.prompt_len, self.reference = prompt_len, reference
        self.round = 0

    def situation(self, ctx):
        return Situation(self, "oracle")

    def propose(self, ctx, k):
        done = len(ctx.tokens) - self.prompt_len
        tokens = list(self.reference[done : done + k])
        tokens += [0] * (k - len(tokens))
        self.round += 1
        bad = self.round % (k + 1)  # == k: no corruption this round
        if bad < k:
            tokens[bad] = (tokens[bad] + 1) % VOCAB
        return Draft(tokens)


def prompts_for(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    phrase = [rng.randrange(256) for _ in range(6)]
    return [
        [rng.randrange(256) for _ in range(rng.randrange(3, 30))],
        phrase * 4 + [rng.randrange(256) for _ in range(3)] + phrase[:3],  # lookup matches
        [rng.randrange(256)],  # a one-token prompt: nothing to prefill
    ]


def run(engine, prompt, proposer, k):
    events = list(engine.stream(prompt, GenerationSettings(max_tokens=MAX_TOKENS, k=k), proposer))
    done = events[-1]
    assert isinstance(done, Done)
    return done


def proposers_for(family, model, target, tokenizer):
    found = [PromptLookup("lookup", ngram_max=3, ngram_min=1, k_max=8)]
    draft = DraftModel(truncated_model(model, 2), name="draft-truncated", k_max=5)
    stranger = DraftModel(tiny_model(family, seed=99), name="draft-other", k_max=4)
    found += [draft, stranger]
    if family in ("llama", "qwen3"):
        found.append(SelfSpeculation(target, layers=1, name="self-spec", k_max=4))
    return found


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_speculation_matches_plain_greedy(family, seed):
    tokenizer = byte_tokenizer()
    model = tiny_model(family, seed=seed)
    engine = Engine(model, tokenizer, family, verify_cost=CPU_LIKE_COST)
    for proposer in proposers_for(family, model, engine.target, tokenizer):
        engine.add_proposer(proposer)
    eos = set(tokenizer.eos_token_ids)
    compared = 0
    for prompt in prompts_for(seed):
        reference = plain_greedy(model, prompt, MAX_TOKENS, eos)
        engine.add_proposer(Oracle(len(prompt), reference))
        for name in ["none", *engine.proposers]:
            for k in [None] if name == "none" else [1, 3, None]:
                done = run(engine, prompt, name, k)
                label = f"{family} seed={seed} proposer={name} k={k} prompt={prompt[:5]}..."
                assert_lossless(model, prompt, reference, list(done.token_ids), label)
                compared += 1
                if name == "oracle" and k == 3 and len(reference) > 6:
                    # The oracle forces rejections: the rollback path really ran.
                    assert 0 < done.record.accepted < done.record.drafted
    assert compared >= 3 * (1 + 3 * 4)


def test_every_rejection_position_is_exercised():
    """With k=4 the oracle corrupts positions 0..3 in turn: each must roll back cleanly."""
    tokenizer = byte_tokenizer()
    model = tiny_model("llama", seed=3)
    prompt = [5, 6, 7, 8, 9]
    reference = plain_greedy(model, prompt, 60, set(tokenizer.eos_token_ids))
    assert len(reference) == 60
    oracle = Oracle(len(prompt), reference, k_max=4)
    engine = Engine(model, tokenizer, "llama", [oracle], verify_cost=CPU_LIKE_COST)
    events = list(engine.stream(prompt, GenerationSettings(max_tokens=60, k=4), "oracle"))
    accepted_counts = {e.accepted for e in events if type(e).__name__ == "Step" and e.drafted == 4}
    assert accepted_counts == {0, 1, 2, 3, 4}
    assert list(events[-1].token_ids) == reference


def test_verify_rounding_is_far_below_the_near_tie_bound():
    """Justify NEAR_TIE: batched-verify logits differ from one-token steps by far less."""
    worst = 0.0
    for family in FAMILIES:
        model = tiny_model(family, seed=0)
        tokens = [random.Random(family).randrange(256) for _ in range(24)]
        batched = make_prompt_cache(model)
        model(mx.array([tokens[:8]]), cache=batched)
        wide = model(mx.array([tokens[8:]]), cache=batched)[0]
        single = make_prompt_cache(model)
        model(mx.array([tokens[:8]]), cache=single)
        rows = [model(mx.array([[t]]), cache=single)[0, -1] for t in tokens[8:]]
        worst = max(worst, mx.abs(wide - mx.stack(rows)).max().item())
    print(f"max |batched - single-step| logit difference: {worst:.2e} (NEAR_TIE={NEAR_TIE})")
    assert worst * 10 < NEAR_TIE


def test_multi_turn_reuses_the_cached_prefix_and_stays_lossless():
    tokenizer = byte_tokenizer()
    model = tiny_model("llama", seed=4)
    engine = Engine(model, tokenizer, "llama", [PromptLookup()], verify_cost=CPU_LIKE_COST)
    eos = set(tokenizer.eos_token_ids)
    first = [10, 11, 12, 13, 14, 15]
    answer = list(run(engine, first, "prompt-lookup", None).token_ids)
    second = first + answer + [20, 21, 22]
    done = run(engine, second, "prompt-lookup", None)
    assert done.record.reused_prompt_tokens >= len(first) + len(answer) - 1
    assert list(done.token_ids) == plain_greedy(model, second, MAX_TOKENS, eos)
    # A prompt that does not extend the last one re-uses only the common part.
    third = first[:3] + [30, 31]
    done = run(engine, third, "prompt-lookup", None)
    assert done.record.reused_prompt_tokens == 3
    assert list(done.token_ids) == plain_greedy(model, third, MAX_TOKENS, eos)
