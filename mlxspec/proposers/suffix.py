"""Suffix decoding: draft what followed the longest earlier match of the context, in
this request and in everything the model said before (its persistent history).

Two prefix indexes answer the same question: the request's own tokens (rebuilt when
the conversation changes, extended each round) and the model's history store (loaded
lazily, shared across requests and processes). The longer match wins (the request's on
a tie, and both are used when equal). Its occurrences' continuations form a tree in
which a node's score is the share of occurrences that continued that way
(SuffixDecoding's frequency scores), so the engine's verify-cost pruning keeps only the
branches that pay. A history match drafts at most `spec_factor` x its length: a long
match has earned a long draft, a two-token match has not.

In the request itself the match is treated as prompt lookup treats it: the draft line
is what followed the latest occurrence, as deep as the policy asks (an answer copying
its prompt matches it by a few tokens where a copied phrase starts, then goes on
verbatim), and a continuation that runs into the present is extended periodically
(copy with overlap), so "Beta Beta Beta" drafts as far as the policy allows instead of
one period. With history on, a shipped seed history (`suffix/seed.py`) counts as
history too.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence

import numpy as np

from mlxspec.proposers.base import Draft, ProposalContext, Situation
from mlxspec.proposers.lookup import PRIORS, bucket
from mlxspec.suffix.index import SENTINEL, PrefixIndex
from mlxspec.suffix.store import HistoryStore
from mlxspec.tree import DraftTree, from_paths, greedy_walk, keep_best

OCCURRENCES = 32  # continuations counted per match (an even sample of a bigger range)
MIN_SHARE = 0.1  # branches fewer occurrences took are not drafted (SuffixDecoding's min prob)
REQUEST, HISTORY = "request", "history"


class SuffixProposer:
    needs_hidden = False
    cost_hint = 0.0

    def __init__(
        self,
        name: str = "suffix",
        store: HistoryStore | None = None,
        k_max: int = 32,
        spec_factor: float = 1.0,
        min_match: int = 2,
        vocab_size: int | None = None,
        seed: Callable[[], PrefixIndex | None] | None = None,
    ):
        if spec_factor <= 0 or min_match < 1:
            raise ValueError(
                f"need spec_factor > 0 and min_match >= 1, got {spec_factor}, {min_match}"
            )
        self.name, self.store, self.k_max = name, store, k_max
        self.spec_factor, self.min_match, self.vocab_size = spec_factor, min_match, vocab_size
        self.seed = seed  # the shipped seed history (suffix/seed.py), read with the user's
        self.reset()

    def reset(self) -> None:
        self._seen: list[int] = []
        self._request = PrefixIndex()
        # This round's match: (length, origin, [(index, lo, hi, is the request's)]).
        self._match: tuple[int, str, list[tuple[PrefixIndex, int, int, bool]]] | None = None
        self._last_origin = REQUEST
        self.drafted = {REQUEST: 0, HISTORY: 0}
        self.history_accepted = 0

    def _sync(self, tokens: list[int]) -> None:
        """Index every position of the request whose next token is known (stream
        position i + 1 holds tokens[i]: the stream starts with a SENTINEL)."""
        if tokens[: len(self._seen)] != self._seen or not self._seen:
            self._request = PrefixIndex(np.array([SENTINEL, *tokens[:-1]], np.int32))
            self._request.append(tokens[-1:])
        else:
            self._request.append(tokens[len(self._seen) :])
            self._request.insert_positions(range(len(self._seen), len(tokens)))
        self._seen = list(tokens)

    def situation(self, ctx: ProposalContext) -> Situation | None:
        tokens = ctx.tokens
        self._sync(tokens)
        self._match = None
        found = [(self._request, *self._request.longest_match(tokens), True)]
        if ctx.history:
            for index in self._histories():
                found.append((index, *index.longest_match(tokens), False))
        length = max(match[1] for match in found)
        if length < self.min_match:
            return None
        ranges = [(index, lo, hi, own) for index, n, lo, hi, own in found if n == length]
        origin = REQUEST if ranges[0][3] else HISTORY
        self._match = (length, origin, ranges)
        return Situation(self, f"{origin}>={bucket(length)}", PRIORS[bucket(length)])

    def _histories(self) -> list[PrefixIndex]:
        """The user's history and the seed (where one ships): both count as history."""
        seed = self.seed() if self.seed is not None else None
        stored = self.store.index if self.store is not None else None
        return [index for index in (stored, seed) if index is not None]

    def _depth(self, asked: int) -> int:
        """A history match drafts at most `spec_factor` x its length; a match in the
        request drafts as deep as the policy asks. An answer that copies its prompt
        matches it by only a few tokens where a copied phrase starts (the answer's own
        words before it differ from the prompt's), yet goes on verbatim: the policy,
        which learns acceptance per `request>=N`, sizes those drafts as it does prompt
        lookup's."""
        if self._match is None:
            return 0
        length, origin, _ = self._match
        if origin == REQUEST:
            return asked
        return min(asked, math.ceil(self.spec_factor * length))

    def _latest(self, depth: int) -> list[int]:
        """What followed the request's latest occurrence of the match (prompt lookup's
        choice: in a copied passage the nearest earlier occurrence is the one being
        copied; a majority of older, shorter occurrences is not)."""
        index, lo, hi, _ = next(r for r in self._match[2] if r[3])
        latest = int(index.order[lo:hi].max())
        return _follow(index.tokens, latest, depth, periodic=True)

    def _continuations(self, depth: int) -> Counter[tuple[int, ...]]:
        """How often each continuation (up to `depth` tokens) followed the match."""
        seen: Counter[tuple[int, ...]] = Counter()
        for index, lo, hi, own in self._match[2]:
            for position in index.occurrences(lo, hi, OCCURRENCES).tolist():
                path = _follow(index.tokens, position, depth, periodic=own)
                if self.vocab_size is not None:  # a store written for another vocabulary
                    path = path[
                        : next((i for i, t in enumerate(path) if t >= self.vocab_size), len(path))
                    ]
                if path:
                    seen[tuple(path)] += 1
        return seen

    def propose(self, ctx: ProposalContext, k: int) -> Draft:
        """The line most occurrences took (a model without draft trees drafts this)."""
        if self._match is None or k <= 0:
            return Draft([])
        if self._match[1] == REQUEST:
            line = self._latest(self._depth(k))
        else:
            children = _children(self._continuations(self._depth(k)))
            line = []
            while children.get(tuple(line)):
                line.append(children[tuple(line)].most_common(1)[0][0])
        self._count(len(line))
        return Draft(line)

    def propose_tree(self, ctx: ProposalContext, depth: int, budget: int) -> DraftTree:
        """Every continuation seen, each node scored by the share of occurrences that
        went through it; branches below MIN_SHARE are left out."""
        if self._match is None:
            return from_paths([], [])
        seen = self._continuations(self._depth(depth))
        total = sum(seen.values())
        children = _children(seen)
        paths, scores = [], []
        if self._match[1] == REQUEST:  # the line `propose` drafts, kept whole (score 1)
            latest = self._latest(self._depth(depth))
            paths.append(latest)
            scores.append([1.0] * len(latest))
        for path in seen:
            shares = [children[path[:j]][path[j]] / total for j in range(len(path))]
            kept = next((j for j, share in enumerate(shares) if share < MIN_SHARE), len(path))
            if kept:
                paths.append(path[:kept])
                scores.append(shares[:kept])
        tree = keep_best(from_paths(paths, scores), budget)
        self._count(max(tree.depths))
        return tree

    def _count(self, drafted: int) -> None:
        self._last_origin = self._match[1]
        self.drafted[self._last_origin] += drafted

    def verified(self, tree: DraftTree, choices: Sequence[int]) -> None:
        """Count drafts from history the target kept (for `mlxspec history`'s hit rate)."""
        if self._last_origin == HISTORY:
            self.history_accepted += len(greedy_walk(tree, choices)[0])

    def annotate(self, record) -> None:
        """Put this request's draft origins in its record, and count its history hits."""
        record.drafted_from_request = self.drafted[REQUEST]
        record.drafted_from_history = self.drafted[HISTORY]
        if self.store is not None and self.store.loaded:
            record.history_tokens = len(self.store.index)
            self.store.count(self.drafted[HISTORY], self.history_accepted)
        self.drafted = {REQUEST: 0, HISTORY: 0}
        self.history_accepted = 0


def _follow(stream: np.ndarray, position: int, depth: int, periodic: bool) -> list[int]:
    """The tokens after `position`, up to `depth`, stopping at a document's end. With
    `periodic` (the request's own stream), a continuation that reaches the end of the
    stream goes on copying itself (the text after a match one period back repeats)."""
    path = stream[position + 1 : position + 1 + depth].tolist()
    if SENTINEL in path:
        return path[: path.index(SENTINEL)]
    if periodic and path:
        period = len(stream) - position - 1
        while len(path) < depth:
            path.append(path[len(path) - period])
    return path


def _children(seen: Counter[tuple[int, ...]]) -> dict[tuple[int, ...], Counter[int]]:
    """For each prefix of a continuation, how often each next token followed it."""
    children: dict[tuple[int, ...], Counter[int]] = defaultdict(Counter)
    for path, count in seen.items():
        for j, token in enumerate(path):
            children[path[:j]][token] += count
    return children
