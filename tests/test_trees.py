"""Draft trees: one verify pass over many candidates, lossless, and exact when sampling."""

from __future__ import annotations

from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from lossless import assert_lossless, plain_greedy
from mlx_lm.models.cache import make_prompt_cache
from test_lossless import CPU_LIKE_COST, MAX_TOKENS, prompts_for, proposers_for
from test_sampling import CRITICAL_DF5, P, chi_square
from tiny_models import VOCAB, byte_tokenizer, tiny_model

from mlxspec.decoding.engine import Engine, GenerationSettings
from mlxspec.models.target import Target
from mlxspec.models.tree import (
    DraftTree,
    best_size,
    chain,
    from_nodes,
    from_paths,
    greedy_walk,
    keep_best,
    sample_walk,
)
from mlxspec.proposers import Draft, Lookahead, PromptLookup, ProposalContext, Situation
from mlxspec.sampling import SamplingSettings, sample_from

# A tree with branching at the root and below, nodes in breadth-first order.
SHAPE = DraftTree([10, 11, 12, 13, 14, 15, 16], [0, 0, 1, 1, 2, 3, 3])


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tree_verify_gives_every_node_the_logits_of_its_own_path(family):
    model = tiny_model(family, seed=2)
    prompt = [5, 17, 99, 3, 42, 7]
    target = Target(model)
    target.prepare(prompt)
    logits, _ = target.verify_tree(prompt[-1], SHAPE)
    assert logits.shape[0] == len(SHAPE) + 1
    for node in range(len(SHAPE) + 1):
        alone = model(mx.array([prompt + SHAPE.path_tokens(node)]))[0, -1]
        assert mx.abs(alone - logits[node]).max().item() < 1e-4, f"node {node}"


@pytest.mark.parametrize("path", [[], [2], [1, 4], [1, 3, 7]])
def test_keeping_a_path_leaves_the_cache_of_plain_decoding(path):
    model = tiny_model("qwen3", seed=4)
    prompt = [9, 8, 7, 6, 5]
    target = Target(model)
    target.prepare(prompt)
    target.verify_tree(prompt[-1], SHAPE)
    target.keep_nodes(prompt[-1], SHAPE, path)
    kept = prompt + [SHAPE.tokens[i - 1] for i in path]
    plain = make_prompt_cache(model)
    model(mx.array([kept]), cache=plain)
    assert target.cached_tokens == kept
    for ours, theirs in zip(target.cache, plain):
        assert ours.offset == theirs.offset == len(kept)
        for a, b in ((ours.keys, theirs.keys), (ours.values, theirs.values)):
            n = len(kept)
            assert mx.abs(a[..., :n, :] - b[..., :n, :]).max().item() < 1e-4


def test_tree_helpers():
    trie = from_paths([[1, 2, 3], [1, 2, 4], [5]], [[0.9, 0.8, 0.7], [0.5, 0.4, 0.3], [0.2]])
    assert trie.tokens == [1, 5, 2, 3, 4] and trie.parents == [0, 0, 1, 3, 3]
    assert trie.scores == [0.9, 0.2, 0.8, 0.7, 0.3]
    best = keep_best(trie, 3)
    assert best.tokens == [1, 2, 3] and best.is_chain
    assert greedy_walk(trie, [1, 2, 0, 4, 0, 0]) == ([1, 3, 5], 0)
    assert greedy_walk(trie, [7, 0, 0, 0, 0, 0]) == ([], 7)
    assert chain([4, 5]).depths == [0, 1, 2]
    cheap, dear = (lambda m: 1.0), (lambda m: float(m))
    assert best_size(trie, cheap) == 5 and best_size(trie, dear) == 0
    with pytest.raises(ValueError):
        DraftTree([1, 2], [0, 2])


class TreeOracle:
    """Drafts a tree around the known plain output: at each depth the right token sits
    at a varying sibling position (or nowhere), under wrong siblings with children of
    their own, so acceptance and rollback run on every branch."""

    needs_hidden = False
    cost_hint = 0.0

    def __init__(self, prompt_len: int, reference: list[int], name: str = "tree-oracle"):
        self.name, self.k_max = name, 4
        self.prompt_len, self.reference, self.round = prompt_len, reference, 0

    def situation(self, ctx):
        return Situation(self, "oracle")

    def propose(self, ctx, k):
        """As a line (a batch asks for one where its round verifies one node): the
        tree's first node, wrong in two rounds of three."""
        return Draft(self.propose_tree(ctx, 1, 1).tokens[:1])

    def propose_tree(self, ctx, depth, budget):
        done = len(ctx.tokens) - self.prompt_len
        right = [*self.reference[done : done + depth], *[0] * depth][:depth]
        self.round += 1
        tokens, parents, parent = [], [], 0
        for d in range(depth):
            slot = (self.round + d) % 3  # 0, 1: right token's sibling position; 2: absent
            wrong = [(right[d] + j) % VOCAB for j in (1, 2)]
            siblings = wrong[:slot] + [right[d]] + wrong[slot:] if slot < 2 else wrong
            next_parent = None
            for token in siblings:
                tokens.append(token)
                parents.append(parent)
                if token == right[d]:
                    next_parent = len(tokens)
                else:  # a wrong branch with a child of its own
                    tokens.append(right[d])
                    parents.append(len(tokens) - 1)
            if next_parent is None:
                break
            parent = next_parent
        return from_nodes(tokens, parents, [1.0] * len(tokens))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tree_greedy_matches_plain_greedy_for_every_proposer(family):
    tokenizer = byte_tokenizer()
    model = tiny_model(family, seed=1)
    engine = Engine(model, tokenizer, family, verify_cost=CPU_LIKE_COST)
    for proposer in proposers_for(family, model, engine.target, tokenizer):
        engine.add_proposer(proposer)
    eos = set(tokenizer.eos_token_ids)
    tree_rounds = 0
    for prompt in prompts_for(7):
        reference = plain_greedy(model, prompt, MAX_TOKENS, eos)
        engine.add_proposer(TreeOracle(len(prompt), reference))
        for name in engine.proposers:
            for k in [3, None]:
                settings = GenerationSettings(max_tokens=MAX_TOKENS, k=k, tree=True)
                done = list(engine.stream(prompt, settings, name))[-1]
                label = f"{family} tree proposer={name} k={k} prompt={prompt[:5]}..."
                assert_lossless(model, prompt, reference, list(done.token_ids), label, done.record)
                record = done.record
                assert record.tree and sum(record.accepted_lengths) == record.verify_steps
                tree_rounds += record.tree_rounds
                if name == "tree-oracle" and k == 3 and len(reference) > 8:
                    assert record.tree_rounds > 0 and 0 < record.accepted < record.drafted
    assert tree_rounds > 20


@pytest.mark.parametrize("family", ["gemma3_text", "lfm2", "qwen3_5", "gpt_oss", "gemma4_text"])
def test_models_without_plain_kv_caches_fall_back_to_a_line_and_say_why(family):
    tokenizer = byte_tokenizer()
    model = tiny_model(family, seed=0)
    engine = Engine(model, tokenizer, family, verify_cost=CPU_LIKE_COST)
    prompt = prompts_for(0)[1]
    reference = plain_greedy(model, prompt, MAX_TOKENS, set(tokenizer.eos_token_ids))
    engine.add_proposer(TreeOracle(len(prompt), reference))
    engine.add_proposer(PromptLookup("lookup", ngram_min=1))
    done = list(
        engine.stream(prompt, GenerationSettings(max_tokens=MAX_TOKENS, tree=True), "lookup")
    )[-1]
    assert not done.record.tree and "KV cache" in done.record.tree_unavailable
    assert_lossless(
        model, prompt, reference, list(done.token_ids), f"{family} fallback", done.record
    )


def simulate_walk(walk, seed: int = 0, trials: int = 40_000) -> Counter:
    """First emitted token over a root with three candidate children (one of them the
    target's favourite), each with a child of its own."""
    tree = DraftTree([4, 0, 5, 1, 2, 3], [0, 0, 0, 1, 2, 3])
    probs = np.vstack([P[0], P[1], P[2], P[1], P[0], P[2], P[1]])
    rng = np.random.default_rng(seed)
    first = Counter()
    for _ in range(trials):
        path, own = walk(tree, probs, rng)
        first[(tree.path_tokens(path[-1]) + [own])[0] if path else own] += 1
    return first


def resample_from_p(tree, probs, rng):
    """A plausible bug: after refusing a candidate, draw from the unchanged p."""
    kids, node, path = tree.children(), 0, []
    while True:
        p = probs[node]
        for child in kids[node]:
            if rng.random() < p[tree.tokens[child - 1]]:
                path.append(child)
                node = child
                break
        else:
            return path, sample_from(p, rng)


def test_multi_candidate_rejection_keeps_the_target_distribution():
    assert chi_square(simulate_walk(sample_walk), P[0]) < CRITICAL_DF5


def test_the_tree_sampling_check_catches_a_broken_rule():
    assert chi_square(simulate_walk(resample_from_p), P[0]) > 10 * CRITICAL_DF5


def test_sampled_tree_runs_reproduce_with_a_seed_and_stay_in_the_model():
    tokenizer = byte_tokenizer()
    model = tiny_model("llama", seed=6, sharpness=4.0)
    engine = Engine(model, tokenizer, "llama", verify_cost=CPU_LIKE_COST)
    prompt = prompts_for(3)[1]
    reference = plain_greedy(model, prompt, 30, set(tokenizer.eos_token_ids))
    engine.add_proposer(TreeOracle(len(prompt), reference))

    def sample(seed):
        settings = GenerationSettings(
            max_tokens=30,
            k=4,
            tree=True,
            sampling=SamplingSettings(temperature=0.7, seed=seed),
        )
        engine.proposers["tree-oracle"].round = 0  # the same trees each run
        return list(engine.stream(prompt, settings, "tree-oracle"))[-1]

    first, again = sample(21), sample(21)
    assert first.token_ids == again.token_ids and first.record.tree_rounds > 0
    assert sample(22).token_ids != first.token_ids


def test_the_bench_runner_verifies_trees_and_reports_them():
    from mlxspec.bench.runners import run_mlxspec
    from mlxspec.proposers import DraftModel, truncated_model

    model = tiny_model("llama", seed=1)
    engine = Engine(model, byte_tokenizer(), "llama", verify_cost=CPU_LIKE_COST)
    engine.add_proposer(DraftModel(truncated_model(model, 2), name="draft"))
    line = run_mlxspec(engine, [3, 4, 5, 6], 24, "draft", 3)
    tree = run_mlxspec(engine, [3, 4, 5, 6], 24, "draft", 3, tree=True)
    assert line.tree_rounds == 0 and tree.tree_rounds > 0
    assert tree.tree_nodes > 3 * tree.tree_rounds  # more than a line of 3 per round
    assert sum(tree.accepted_lengths) == tree.verify_steps
    assert tree.tokens == line.tokens


def test_lookahead_takes_the_next_jacobi_iterate_and_its_ngrams():
    look = Lookahead(window=3, ngram=2, guesses=2)
    ctx = ProposalContext([1, 2, 3], None, None, None)
    tree = look.propose_tree(ctx, 3, 32)
    assert tree.tokens == [3, 3, 3] and tree.is_chain  # a fresh window repeats the pending
    look.verified(tree, [7, 8, 9, 4])  # target outputs at the root and the three guesses
    assert look.guess == [7, 8, 9]
    assert look.pool[7] and list(look.pool[8]) == [(9,)]
    # Two tokens later (one accepted, one corrected) the window has moved on by two.
    ctx = ProposalContext([1, 2, 3, 7, 5], None, None, None)
    tree = look.propose_tree(ctx, 3, 32)
    assert tree.path_tokens(3) == [9, 9, 9]
    with pytest.raises(ValueError):
        Lookahead(window=0)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text", "lfm2"])
def test_lookahead_is_lossless_and_gets_drafts_accepted(family):
    tokenizer = byte_tokenizer()
    model = tiny_model(family, seed=2)
    engine = Engine(model, tokenizer, family, [Lookahead()], verify_cost=CPU_LIKE_COST)
    eos = set(tokenizer.eos_token_ids)
    accepted = tree_rounds = 0
    for prompt in prompts_for(5):
        reference = plain_greedy(model, prompt, MAX_TOKENS, eos)
        for k in [4, None]:
            settings = GenerationSettings(max_tokens=MAX_TOKENS, k=k)
            done = list(engine.stream(prompt, settings, "lookahead"))[-1]
            label = f"{family} lookahead k={k} prompt={prompt[:5]}..."
            assert_lossless(model, prompt, reference, list(done.token_ids), label, done.record)
            accepted += done.record.accepted
            tree_rounds += done.record.tree_rounds
    if family != "gemma3_text":  # its random output never repeats: nothing to guess
        assert accepted > 0, "lookahead never guessed right on a looping random model"
    assert (tree_rounds > 0) == (family in ("llama", "qwen3"))  # others: the window as a line
