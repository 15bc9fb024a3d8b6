"""Suffix decoding: which source drafts a round, the request's line or the history's.

Requests of one kind end their prompts alike (the instruction, the chat template's
assistant header) and begin their answers alike, so an earlier request matches the
context longer than the request's own copy of its input does, but only through the
prompt (measured on the agent suite: docs/design/suffix.md).
"""

from __future__ import annotations

import pytest
from test_suffix import generate, history_engine

from mlxspec.decoding.engine import GenerationSettings
from mlxspec.proposers.base import ProposalContext
from mlxspec.proposers.suffix import SuffixProposer
from mlxspec.suffix.store import HistoryStore

TEMPLATE = [90, 91, 92]  # the tail every prompt of this kind ends with
START = [60, 61]  # how every answer of this kind begins


def answer_context(prompt: list[int], answer: list[int]) -> ProposalContext:
    return ProposalContext([*prompt, *answer], None, None, None, prompt_length=len(prompt))


def copying_store(tmp_path) -> HistoryStore:
    """An earlier request whose answer copied its own input (70..73)."""
    store = HistoryStore(tmp_path)
    store.add([10, 11, *START, 70, 71, 72, 73, *TEMPLATE, *START, 70, 71, 72, 73])
    return store


def test_a_history_match_long_only_through_the_prompt_leaves_the_request_its_line(tmp_path):
    """History matches 5 tokens (3 of them prompt), the request 2: the answer is copying
    this request's input (80..83), not the earlier one's."""
    prompt = [20, 21, *START, 80, 81, 82, 83, *TEMPLATE]
    ctx = answer_context(prompt, START)
    proposer = SuffixProposer(store=copying_store(tmp_path))
    assert proposer.situation(ctx).key == "request>=2"
    assert proposer.propose(ctx, 4).tokens == [80, 81, 82, 83]


def test_both_lines_ride_in_the_tree(tmp_path):
    """The request drafts, and the history's continuation is a branch beside it."""
    prompt = [20, 21, *START, 80, 81, 82, 83, *TEMPLATE]
    ctx = answer_context(prompt, START)
    proposer = SuffixProposer(store=copying_store(tmp_path))
    proposer.situation(ctx)
    tree = proposer.propose_tree(ctx, 4, 16)
    leaves = [i for i in range(1, len(tree) + 1) if i not in tree.parents]
    lines = sorted(tree.path_tokens(leaf) for leaf in leaves)
    assert lines == [[70, 71, 72, 73], [80, 81, 82, 83]]
    first = {tree.tokens[i]: tree.scores[i] for i, p in enumerate(tree.parents) if p == 0}
    assert first[80] == 1.0 and first[70] < first[80]  # the drafting line is kept whole


def test_history_drafts_once_the_answer_itself_matches_it_longer(tmp_path):
    """Four answer tokens go on as an earlier answer did; the request has a two-token
    match in its prompt: the earlier answer's continuation drafts."""
    store = HistoryStore(tmp_path)
    store.add([1, 2, *TEMPLATE, 50, 51, 52, 53, 54, 55, 56])
    prompt = [5, 52, 53, 99, *TEMPLATE]
    ctx = answer_context(prompt, [50, 51, 52, 53])
    proposer = SuffixProposer(store=store)
    assert proposer.situation(ctx).key == "history>=4"
    assert proposer.propose(ctx, 3).tokens == [54, 55, 56]


def test_a_repeated_prompt_counts_its_whole_match(tmp_path):
    """The same prompt again (a retry): the earlier answer drafts from the first token,
    though the request has a short match of its own."""
    prompt = [*range(100, 140), *START, 80, 81, *TEMPLATE]
    store = HistoryStore(tmp_path)
    store.add([*prompt, *START, 70, 71])
    ctx = answer_context(prompt, START)
    proposer = SuffixProposer(store=store)
    assert proposer.situation(ctx).key == "history>=32"
    assert proposer.propose(ctx, 2).tokens == [70, 71]


class PromptLengthSpy(SuffixProposer):
    """Records (context length, prompt length) each round."""

    def situation(self, ctx):
        self.seen.append((len(ctx.tokens), ctx.prompt_length))
        return super().situation(ctx)


@pytest.mark.parametrize("batched", [False, True])
def test_the_loops_tell_proposers_where_the_prompt_ends(batched, tmp_path):
    """The single loop and the batch both say how much of the context is prompt."""
    store = HistoryStore(tmp_path)
    _, _, engine = history_engine("llama", 0, store)
    spy = PromptLengthSpy("spy", store, k_max=4, vocab_size=engine.vocab_size)
    spy.seen = []
    engine.add_proposer(spy)
    prompt, settings = list(range(40, 52)), GenerationSettings(max_tokens=8)
    generate(engine, prompt, settings, "spy", batched)
    # The first round drafts the answer's first token: no answer yet.
    assert spy.seen[0] == (len(prompt), len(prompt))
    assert len(spy.seen) > 1 and all(length == len(prompt) for _, length in spy.seen)


def test_every_shipped_entry_lets_suffix_draft_as_deep_as_prompt_lookup(monkeypatch, tmp_path):
    """A long verbatim copy (code edited in place) is drafted from the request as prompt
    lookup drafts it; a shallower cap alone cost suffix 3 % on the code-edit prompts."""
    from mlxspec.registry.models_toml import load_registry

    monkeypatch.delenv("MLXSPEC_MODELS", raising=False)  # the shipped file only
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    for name, entry in load_registry().entries.items():
        lookup, suffix = entry.proposer("prompt-lookup"), entry.proposer("suffix")
        assert suffix.options["k_max"] >= lookup.options["k_max"], name
