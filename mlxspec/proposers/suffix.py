"""Suffix decoding: draft what followed the longest earlier match of the context, in
this request and in everything the model said before (its persistent history).

Two prefix indexes answer the same question: the request's own tokens (rebuilt when
the conversation changes, extended each round) and the model's history store (loaded
lazily, shared across requests and processes). In the request the match is treated as
prompt lookup treats it: the draft line is what followed the latest occurrence, as deep
as the policy asks (an answer copying its prompt matches it by a few tokens where a
copied phrase starts, then goes on verbatim), and a continuation that runs into the
present is extended periodically (copy with overlap), so "Beta Beta Beta" drafts as far
as the policy allows instead of one period. In the history, the occurrences'
continuations form a tree in which a node's score is the share of occurrences that
continued that way (SuffixDecoding's frequency scores), and a history match drafts at
most `spec_factor` x its length. Its situation carries the counts along its line, so the
policy sizes the draft by them (`Policy._expected_from_evidence`). With history on, a
shipped seed history (`suffix/seed.py`) counts as history too.

Which one drafts: the request's line, unless the history matches longer *inside this
request's answer*. A history match that reaches back into the prompt is long because
requests of one kind end alike (the same instruction, the chat template's assistant
header) and begin their answers alike; that says the request is of the same kind, not
that its answer goes on as an earlier one did. Measured on the agent suite
(benchmarks/suffix_rounds.py): on the first meeting-notes request, an 8-token history
match, seven of them the prompt's end and the chat template, drafted 8 tokens of which
none was kept, where the request's own 2-token match would have kept 15. Only a match of
MAX_MATCH tokens (a repeated prompt) counts whole. The other source rides along in the
draft tree.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from mlxspec.models.tree import DraftTree, from_paths, greedy_walk, keep_best
from mlxspec.proposers.base import Draft, ProposalContext, Situation
from mlxspec.proposers.lookup import CHECKED, PRIORS, bucket
from mlxspec.suffix.index import MAX_MATCH, SENTINEL, PrefixIndex
from mlxspec.suffix.store import HistoryStore

OCCURRENCES = 32  # continuations counted per match (an even sample of a bigger range)
# Occurrences of a request match read to find its latest: a two-token match in 100k
# tokens of code has thousands, and a round must not read them all.
LATEST_SCANNED = 256
MIN_SHARE = 0.1  # branches fewer occurrences took are not drafted (SuffixDecoding's min prob)
REQUEST, HISTORY = "request", "history"


@dataclass
class Match:
    """This round's matches: the request's (its range in the request index, or None if
    shorter than min_match) and the history's (the ranges of its longest match, over the
    user's store and the seed); `origin` says which one drafts the line."""

    origin: str
    request_length: int = 0
    request: tuple[int, int] | None = None
    history_length: int = 0
    history: list[tuple[PrefixIndex, int, int]] = field(default_factory=list)
    # The history's line (the branch most occurrences took, as deep as this match may
    # draft) and its counts per position: (occurrences that went on so, that got so far).
    line: list[int] = field(default_factory=list)
    evidence: tuple[tuple[int, int], ...] = ()
    # The continuations counted for them, and how deep (the tree reads them again).
    continuations: Counter[tuple[int, ...]] = field(default_factory=Counter)
    counted_depth: int = 0

    @property
    def length(self) -> int:
        return self.request_length if self.origin == REQUEST else self.history_length


def counted_length(history_length: int, answer_length: int) -> int:
    """The part of a history match that speaks for this answer: the tokens inside it (the
    prompt's tail is the same in every request of a kind), all of it when it is
    MAX_MATCH long (the prompt itself repeats one seen before)."""
    if history_length >= MAX_MATCH:
        return history_length
    return min(history_length, answer_length)


class SuffixProposer:
    needs_hidden = False
    cost_hint = 0.0

    def __init__(
        self,
        name: str = "suffix",
        store: HistoryStore | None = None,
        k_max: int = 32,
        spec_factor: float = 2.0,
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
        self._indexed = 0  # tokens of the request indexed so far
        self._ends: tuple[list[int], list[int]] = ([], [])  # its first and last CHECKED
        self._request = PrefixIndex()
        self._match: Match | None = None
        self._last_origin = REQUEST
        self.drafted = {REQUEST: 0, HISTORY: 0}
        self.history_accepted = 0

    def _sync(self, tokens: list[int]) -> None:
        """Index every position of the request whose next token is known (stream
        position i + 1 holds tokens[i]: the stream starts with a SENTINEL).

        A round's work is bounded by the new tokens and CHECKED at each end of what was
        indexed (prompt lookup's test of a grown sequence), not by the context: comparing
        and copying all of it cost 2.3 ms a round at 128k tokens."""
        indexed, (head, tail) = self._indexed, self._ends
        grown = 0 < indexed <= len(tokens) and tokens[:CHECKED] == head
        if not grown or tokens[max(indexed - CHECKED, 0) : indexed] != tail:
            self._request = PrefixIndex(np.array([SENTINEL, *tokens[:-1]], np.int32))
            self._request.append(tokens[-1:])
        else:
            self._request.append(tokens[indexed:])
            self._request.insert_positions(range(indexed, len(tokens)))
        self._indexed = len(tokens)
        self._ends = (tokens[:CHECKED], tokens[-CHECKED:])

    def situation(self, ctx: ProposalContext) -> Situation | None:
        tokens = ctx.tokens
        self._sync(tokens)
        self._match = None
        request_length, lo, hi = self._request.longest_match(tokens)
        history_length, history = self._history_match(tokens) if ctx.history else (0, [])
        if history_length < self.min_match:
            history_length, history = 0, []
        request = (lo, hi) if request_length >= self.min_match else None
        if request is None and not history:
            return None
        answer_length = len(tokens) - ctx.prompt_length
        if request is not None and request_length >= counted_length(history_length, answer_length):
            origin = REQUEST
        else:
            origin = HISTORY
        self._match = Match(origin, request_length, request, history_length, history)
        if origin == HISTORY:
            self._match.line, self._match.evidence = self._history_line(self.k_max)
        length = self._match.length
        return Situation(
            self, f"{origin}>={bucket(length)}", PRIORS[bucket(length)], self._match.evidence
        )

    def _history_match(self, tokens: list[int]) -> tuple[int, list[tuple[PrefixIndex, int, int]]]:
        """The longest match over the history indexes, and its ranges (all of them on a
        tie: the user's history and the seed count alike)."""
        found = [(index, *index.longest_match(tokens)) for index in self._histories()]
        length = max((n for _, n, _, _ in found), default=0)
        return length, [(index, lo, hi) for index, n, lo, hi in found if n == length]

    def _histories(self) -> list[PrefixIndex]:
        """The user's history and the seed (where one ships): both count as history."""
        seed = self.seed() if self.seed is not None else None
        stored = self.store.index if self.store is not None else None
        return [index for index in (stored, seed) if index is not None]

    def _history_depth(self, asked: int) -> int:
        """A history match drafts at most `spec_factor` x its length: a long match has
        earned a long draft, a two-token one has not (SuffixDecoding's max_spec). A match
        in the request drafts as deep as the policy asks: an answer copying its prompt
        matches it by a few tokens where a copied phrase starts, yet goes on verbatim,
        and the policy learns acceptance per `request>=N` as it does for prompt lookup."""
        return min(asked, math.ceil(self.spec_factor * self._match.history_length))

    def _latest(self, depth: int) -> list[int]:
        """What followed the request's latest occurrence of the match (prompt lookup's
        choice: in a copied passage the nearest earlier occurrence is the one being
        copied; a majority of older, shorter occurrences is not). Of a match with more
        than LATEST_SCANNED occurrences (a common short one, in a long context) the
        latest of an even sample: a round reads a bounded part of the index."""
        lo, hi = self._match.request
        latest = int(self._request.occurrences(lo, hi, LATEST_SCANNED)[0])
        return _follow(self._request.tokens, latest, depth, periodic=True)

    def _history_line(self, depth: int) -> tuple[list[int], tuple[tuple[int, int], ...]]:
        """The branch most history occurrences took, up to `depth` (and the match's
        depth cap), and at each of its positions how many occurrences went on with its
        token out of those that got that far: the policy's per-position evidence.
        (Walked along the line only: every round pays for it, drafting or not.)"""
        alive = list(self._continuations(self._history_depth(depth)).items())
        line, evidence = [], []
        while alive:
            j, following = len(line), {}
            for path, count in alive:
                following[path[j]] = following.get(path[j], 0) + count
            token = max(following, key=following.__getitem__)  # ties: the first seen
            line.append(token)
            evidence.append((following[token], sum(following.values())))
            alive = [(p, n) for p, n in alive if p[j] == token and len(p) > j + 1]
        return line, tuple(evidence)

    def _continuations(self, depth: int) -> Counter[tuple[int, ...]]:
        """How often each continuation (up to `depth` tokens) followed the history match;
        counted once a round, then cut shorter where a shallower depth is asked."""
        match = self._match
        if match.counted_depth >= depth:
            seen: Counter[tuple[int, ...]] = Counter()
            for path, count in match.continuations.items():
                seen[path[:depth]] += count
            return seen
        seen = Counter()
        for index, lo, hi in match.history:
            for position in index.occurrences(lo, hi, OCCURRENCES).tolist():
                path = _follow(index.tokens, position, depth, periodic=False)
                if self.vocab_size is not None:  # a store written for another vocabulary
                    path = path[
                        : next((i for i, t in enumerate(path) if t >= self.vocab_size), len(path))
                    ]
                if path:
                    seen[tuple(path)] += 1
        match.continuations, match.counted_depth = seen, depth
        return seen

    def propose(self, ctx: ProposalContext, k: int) -> Draft:
        """The request's latest line, or the line most history occurrences took (a model
        without draft trees drafts this)."""
        if self._match is None or k <= 0:
            return Draft([])
        if self._match.origin == REQUEST:
            line = self._latest(k)
        else:
            line = self._match.line[: self._history_depth(k)]
        self._last_origin = self._match.origin
        return Draft(line)

    def propose_tree(self, ctx: ProposalContext, depth: int, budget: int) -> DraftTree:
        """Both sources in one tree: the request's latest line and every continuation
        seen in history, each history node scored by the share of occurrences that went
        through it (branches below MIN_SHARE left out). The drafting source's scores
        stand as they are (its line, the one `propose` drafts, is kept whole); the other
        source's are discounted by its match length's prior acceptance per token, so its
        nodes are kept only where they pay."""
        if self._match is None:
            return from_paths([], [])
        match, paths, scores = self._match, [], []

        def weight(origin: str, length: int, j: int) -> float:
            return 1.0 if origin == match.origin else PRIORS[bucket(length)] ** (j + 1)

        if match.request is not None:
            line = self._latest(depth)
            paths.append(line)
            scores.append([weight(REQUEST, match.request_length, j) for j in range(len(line))])
        if match.history:
            seen = self._continuations(self._history_depth(depth))
            total, children = sum(seen.values()), _children(seen)
            for path in seen:
                shares = [children[path[:j]][path[j]] / total for j in range(len(path))]
                kept = next((j for j, share in enumerate(shares) if share < MIN_SHARE), len(path))
                if kept:
                    paths.append(path[:kept])
                    scores.append(
                        [shares[j] * weight(HISTORY, match.history_length, j) for j in range(kept)]
                    )
        self._last_origin = match.origin
        return keep_best(from_paths(paths, scores), budget)

    def verified(self, tree: DraftTree, choices: Sequence[int]) -> None:
        """Count the drafts as verified, by origin, and those from history the target kept
        (for `mlxspec history`'s hit rate). Counted here, not when drafted: a batch may
        cut a draft to its round's width, and what it cut was never a draft."""
        self.drafted[self._last_origin] += max(tree.depths)
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
