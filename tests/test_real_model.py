"""Lossless on the real SmolLM2-135M: every shipped proposer, greedy, token for token."""

from __future__ import annotations

import mlx.core as mx
import pytest
from lossless import assert_lossless, plain_greedy
from test_batch import collect
from test_batch_trees import FAN
from test_trees import SHAPE

from mlxspec.batch.scheduler import Scheduler
from mlxspec.batch.target import BatchTarget, Prefill
from mlxspec.decoding.engine import GenerationSettings
from mlxspec.registry.models_toml import load_registry
from mlxspec.registry.runtime import Runtime

pytestmark = pytest.mark.slow
# Alone (tests/side_by_side.py): an adaptive row must draft, and beside the other worker the
# policy priced SmolLM2's drafts out on a contended core. A fixed draft length drafts
# however busy the machine, and greedy output does not depend on timing: those run beside.
ADAPTIVE = pytest.mark.alone

PROMPTS = [
    "Repeat this list exactly: apples, pears, plums, figs, dates, limes, kiwis.",
    "Rename the variable `total` to `acc` in this code:\n"
    "def add(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total\n",
    "What is the capital of France? Answer in one sentence.",
]
# A refused draft kept in the cache and a batched tree's nodes at their index, not their
# depth, each fail this file at 24 tokens as at 40 (docs/design/test-suite.md).
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def runtime(smollm2):
    entry = load_registry(user_file=None).get("smollm2-135m")
    return Runtime(entry, smollm2, notify=print)


@pytest.fixture(scope="module")
def prompts(runtime):
    """Each prompt's chat tokens."""
    encode = runtime.engine.encode_chat
    return {text: encode([{"role": "user", "content": text}]) for text in PROMPTS}


@pytest.fixture(scope="module")
def references(prompts, smollm2):
    """Each prompt's tokens and plain greedy output, made once for the module: every
    proposer and the batch compare against the same reference (when each test made its
    own, the references took a third of the file's time)."""
    eos = set(smollm2.tokenizer.eos_token_ids)
    return {
        text: (prompt, plain_greedy(smollm2.model, prompt, MAX_TOKENS, eos))
        for text, prompt in prompts.items()
    }


@pytest.mark.parametrize(
    "proposer,k,tree",
    [  # fixed k first: the module's references are built beside the other worker, and
        # the adaptive rows then run alone in one stretch (tests/side_by_side.py)
        ("self-spec", 3, False),
        ("draft-model", 3, False),
        ("head", 4, False),
        ("head", 4, True),
        pytest.param("prompt-lookup", None, False, marks=ADAPTIVE),
        pytest.param("auto", None, False, marks=ADAPTIVE),
        pytest.param("head", None, False, marks=ADAPTIVE),
        pytest.param("prompt-lookup", None, True, marks=ADAPTIVE),
        pytest.param("lookup-head", None, True, marks=ADAPTIVE),
    ],
)
def test_every_proposer_is_lossless_on_smollm2(runtime, smollm2, references, proposer, k, tree):
    engine = runtime.engine
    name = runtime.proposer(proposer)
    drafted = tree_rounds = 0
    for text in PROMPTS:
        prompt, reference = references[text]
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


@ADAPTIVE
def test_copying_prompt_accepts_most_lookup_drafts(runtime):
    engine = runtime.engine
    name = runtime.proposer("prompt-lookup")
    done = list(
        engine.stream(
            [{"role": "user", "content": PROMPTS[0]}],
            GenerationSettings(max_tokens=40),  # the whole list
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


@ADAPTIVE  # the batch prices its rows' columns from its own timings
def test_a_batch_of_lines_and_trees_is_lossless_on_smollm2(runtime, smollm2, references):
    """Every prompt twice in one batch: as a head's tree at a fixed depth (it branches),
    as a prompt-lookup tree and as plain decoding; each row's output is its own plain
    greedy output, and the head's trees were verified beside other rows."""
    engine = runtime.engine
    scheduler = Scheduler(engine, max_batch=8)
    head, lookup = runtime.proposer("head"), runtime.proposer("prompt-lookup")
    asked = {}
    for text in PROMPTS:
        prompt, reference = references[text]
        for proposer, k in [(head, 4), (lookup, None), (None, None)]:
            settings = GenerationSettings(max_tokens=MAX_TOKENS, k=k, tree=proposer is not None)
            asked[scheduler.submit(prompt, settings, proposer)] = (prompt, reference, proposer)
    events = collect(scheduler)
    tree_rounds = 0
    for request_id, (prompt, reference, proposer) in asked.items():
        done = events[request_id][-1]
        label = f"batched {proposer} {prompt[-8:]}"
        assert_lossless(smollm2.model, prompt, reference, list(done.token_ids), label, done.record)
        assert any(done.record.batch_sizes[2:]), f"{label} never shared a round"
        if proposer == head:
            tree_rounds += done.record.tree_rounds
    assert tree_rounds > 0, "no head row verified a branching tree in the batch"


def test_batched_tree_nodes_get_the_logits_of_their_own_path_on_smollm2(smollm2, prompts):
    """Two rows of different lengths verify trees of different shapes in one pass: every
    node's logits are those of its own path fed alone. (Greedy equality above hardly
    notices a node at the wrong RoPE position or seeing its siblings on confident text;
    logits do: 4-8 apart, seen.)"""
    model = smollm2.model
    prompts = [prompts[text] for text in PROMPTS[::2]]
    target = BatchTarget(model)
    for prompt in prompts:
        prefill = Prefill(model, prompt[:-1])
        prefill.advance(len(prompt))
        target.join([prefill])
    trees = [SHAPE, FAN]
    rows = [[prompt[-1], *tree.tokens] for prompt, tree in zip(prompts, trees)]
    logits, _ = target.verify_tree(rows, trees)
    for row, (prompt, tree) in enumerate(zip(prompts, trees)):
        alone = logits_along_own_paths(model, prompt, tree)
        for node in range(len(tree) + 1):
            gap = mx.abs(alone[node] - logits[row, node]).max().item()
            assert gap < 0.05, f"row {row} node {node}: logits {gap:.3f} from its path's own"


def logits_along_own_paths(model, prompt: list[int], tree) -> list[mx.array]:
    """The logits after each node's path (root first) with nothing but the prompt and that
    path before it: one causal pass per leaf (prompt + the leaf's path, right-padded, all
    leaves in one batch) reads every node on the way, padding after a node unseen by it."""
    kids, depths = tree.children(), tree.depths
    leaves = [node for node in range(1, len(tree) + 1) if not kids[node]]
    paths = [prompt + tree.path_tokens(leaf) for leaf in leaves]
    width = max(map(len, paths))
    out = model(mx.array([path + [0] * (width - len(path)) for path in paths]))
    alone = {}
    for row, leaf in enumerate(leaves):
        node = leaf
        while True:
            alone.setdefault(node, out[row, len(prompt) - 1 + depths[node]])
            if node == 0:
                break
            node = tree.parents[node - 1]
    return [alone[node] for node in range(len(tree) + 1)]
