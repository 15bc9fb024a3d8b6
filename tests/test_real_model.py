"""Lossless on the real SmolLM2-135M: every shipped proposer, greedy, token for token."""

from __future__ import annotations

import pytest
from lossless import assert_lossless, plain_greedy

from mlxspec.engine import GenerationSettings
from mlxspec.registry import load_registry
from mlxspec.runtime import Runtime

pytestmark = pytest.mark.slow

PROMPTS = [
    "Repeat this list exactly: apples, pears, plums, figs, dates, limes, kiwis.",
    "Rename the variable `total` to `acc` in this code:\n"
    "def add(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total\n",
    "What is the capital of France? Answer in one sentence.",
]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def runtime(smollm2):
    entry = load_registry(user_file=None).get("smollm2-135m")
    return Runtime(entry, smollm2, notify=print)


@pytest.mark.parametrize(
    "proposer,k,tree",
    [
        ("prompt-lookup", None, False),
        ("self-spec", 3, False),
        ("draft-model", 3, False),
        ("auto", None, False),
        ("head", 4, False),
        ("head", None, False),
        ("prompt-lookup", None, True),
        ("head", 4, True),
        ("lookup-head", None, True),
    ],
)
def test_every_proposer_is_lossless_on_smollm2(runtime, smollm2, proposer, k, tree):
    engine = runtime.engine
    name = runtime.proposer(proposer)
    eos = set(smollm2.tokenizer.eos_token_ids)
    drafted = tree_rounds = 0
    for text in PROMPTS:
        prompt = engine.encode_chat([{"role": "user", "content": text}])
        reference = plain_greedy(smollm2.model, prompt, MAX_TOKENS, eos)
        settings = GenerationSettings(max_tokens=MAX_TOKENS, k=k, tree=tree)
        done = list(engine.stream(prompt, settings, name))[-1]
        assert_lossless(
            smollm2.model,
            prompt,
            reference,
            list(done.token_ids),
            f"{name} {text[:30]}",
            done.record,
        )
        drafted += done.record.drafted
        tree_rounds += done.record.tree_rounds
    assert drafted > 0, "the proposer never drafted: nothing was tested"
    if tree and k is not None:  # a fixed depth keeps every node: the trees branch
        assert tree_rounds > 0, "no branching tree was verified"


def test_copying_prompt_accepts_most_lookup_drafts(runtime):
    engine = runtime.engine
    name = runtime.proposer("prompt-lookup")
    done = list(
        engine.stream(
            [{"role": "user", "content": PROMPTS[0]}],
            GenerationSettings(max_tokens=MAX_TOKENS),
            name,
        )
    )[-1]
    assert "kiwis" in done.text
    assert done.record.acceptance_rate > 0.5, done.record.to_dict()


def test_shipped_head_is_accepted_on_open_chat(runtime):
    """The packaged head was trained on the target's own answers; on a question it never
    saw (where lookup finds nothing to copy) some first drafts are right (a head that
    does not fit the target: ~0; the shipped head is still weak, see docs/drafters.md)."""
    engine = runtime.engine
    name = runtime.proposer("head")
    messages = [{"role": "user", "content": "Why do cats purr? Answer in a short paragraph."}]
    done = list(engine.stream(messages, GenerationSettings(max_tokens=MAX_TOKENS, k=3), name))[-1]
    record = done.record.to_dict()
    print(record["acceptance_by_position"], record["acceptance_rate"])
    assert record["acceptance_by_position"][0] > 0.05, record
