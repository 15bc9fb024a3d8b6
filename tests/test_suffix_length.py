"""Suffix decoding: a history match's draft length comes from its own counts.

The policy prices draft position j at its learned rate times the share of earlier
occurrences that went on with the line there (SuffixDecoding's path probability), and
nothing past the line's end: a continuation every occurrence followed drafts as far as
the learned rate pays for, one where the occurrences part ways stops there, one that
ends stops at its end, all at the same match length and learned rate.
"""

from __future__ import annotations

from test_lossless import CPU_LIKE_COST

from mlxspec.decoding.policy import Policy
from mlxspec.proposers.base import ProposalContext
from mlxspec.proposers.suffix import SuffixProposer
from mlxspec.suffix.store import HistoryStore

AGREED = list(range(10, 18))  # an 8-token context every earlier request went on alike after
PARTED = list(range(30, 38))  # one whose earlier requests parted after one token
ENDED = list(range(20, 28))  # one after which every earlier request ended two tokens later


def fabricated_store(tmp_path) -> HistoryStore:
    """Four earlier requests: each followed AGREED by the same 16 tokens, PARTED by the
    same token 60, then each by its own, and ended two tokens after ENDED."""
    store = HistoryStore(tmp_path)
    for request in range(4):
        store.add(
            [1, *AGREED, *range(40, 56), 2, *PARTED, 60, 70 + request, *range(80, 94)]
            + [3, *ENDED, 61, 62]
        )
    return store


def chosen_length(proposer: SuffixProposer, policy: Policy, context: list[int]) -> int:
    situation = proposer.situation(ProposalContext([99, *context], None, None, None))
    assert situation.key == "history>=8"  # every case: one match length, one learned rate
    return policy.choose(situation, 32)


def test_a_long_agreed_continuation_drafts_long_a_parting_one_short(tmp_path):
    proposer = SuffixProposer(store=fabricated_store(tmp_path))
    policy = Policy(CPU_LIKE_COST)
    assert chosen_length(proposer, policy, AGREED) >= 4
    assert chosen_length(proposer, policy, PARTED) == 1  # 4 of 4 went on with 60, then 1 of 4
    assert chosen_length(proposer, policy, ENDED) == 2  # nothing is drafted past the line


def test_without_the_counts_all_three_draft_alike(tmp_path):
    """The lengths above come from the counts: a policy that ignores them drafts the
    same length in all three places (one rate for every position)."""
    proposer = SuffixProposer(store=fabricated_store(tmp_path))
    policy = Policy(CPU_LIKE_COST, read_evidence=False)
    lengths = {chosen_length(proposer, policy, context) for context in (AGREED, PARTED, ENDED)}
    assert len(lengths) == 1 and lengths.pop() >= 4
