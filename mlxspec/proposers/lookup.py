"""Prompt lookup: propose what followed the latest earlier occurrence of the current suffix.

Needs no weights and costs almost nothing, so it is the universal fallback. An
incremental index maps every n-gram (ngram_min..ngram_max) to the position after its
most recent occurrence; each round adds only the new tokens, then looks the suffix up
from the longest n down. The real match length (extended backwards past ngram_max)
labels the case, so the policy learns that long verbatim matches deserve long drafts.
"""

from __future__ import annotations

from mlxspec.models.tree import DraftTree, from_paths, keep_best
from mlxspec.proposers.base import Draft, ProposalContext, Situation

MATCH_BUCKETS = (1, 2, 3, 4, 8, 16, 32)  # case labels: match length rounded down to these
# Acceptance to expect per bucket before evidence: short matches in open text are
# mostly coincidences, long verbatim matches mostly copies.
PRIORS = {1: 0.1, 2: 0.2, 3: 0.3, 4: 0.4, 8: 0.6, 16: 0.75, 32: 0.85}
RECENT = 4  # occurrences remembered per n-gram: the branches a draft tree can take
# Tokens at each end of what was indexed that a round compares with the new context, to
# tell a grown sequence from another one: a round's work is bounded by this and the new
# tokens, not by the context (comparing and copying all of it cost 1.8 ms a round at 32k
# tokens). An index kept for another sequence that agrees at both ends only drafts
# badly: drafts are verified, so the answer is the same.
CHECKED = 64


def bucket(length: int) -> int:
    return max(b for b in MATCH_BUCKETS if b <= length)


class PromptLookup:
    needs_hidden = False
    cost_hint = 0.0

    def __init__(
        self, name: str = "prompt-lookup", ngram_max: int = 4, ngram_min: int = 2, k_max: int = 64
    ):
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min}..{ngram_max}")
        self.name, self.ngram_max, self.ngram_min, self.k_max = name, ngram_max, ngram_min, k_max
        self._indexed = 0  # tokens of the sequence indexed so far
        self._ends: tuple[list[int], list[int]] = ([], [])  # its first and last CHECKED
        # n-gram -> indices of the tokens after its latest occurrences (most recent last)
        self._follow: dict[tuple[int, ...], list[int]] = {}
        self._match: tuple[int, int] | None = None  # (follow index, match length) of this round

    def _sync(self, tokens: list[int]) -> None:
        indexed, (head, tail) = self._indexed, self._ends
        grown = indexed <= len(tokens) and tokens[:CHECKED] == head
        if not grown or tokens[max(indexed - CHECKED, 0) : indexed] != tail:
            indexed, self._follow = 0, {}
        # Index n-grams ending at positions whose next token is known (all but the last).
        for end in range(max(indexed - 1, 0), len(tokens) - 1):
            for n in range(self.ngram_min, self.ngram_max + 1):
                if end + 1 >= n:
                    recent = self._follow.setdefault(tuple(tokens[end + 1 - n : end + 1]), [])
                    recent.append(end + 1)
                    del recent[:-RECENT]
        self._indexed = len(tokens)
        self._ends = (tokens[:CHECKED], tokens[-CHECKED:])

    def situation(self, ctx: ProposalContext) -> Situation | None:
        tokens = ctx.tokens
        self._sync(tokens)
        self._match = None
        for n in self._orders(tokens):
            recent = self._follow.get(tuple(tokens[len(tokens) - n :]))
            if recent:
                length = _match_length(tokens, recent[-1], n)
                self._match = (recent[-1], length)
                return Situation(self, f"match>={bucket(length)}", PRIORS[bucket(length)])
        return None

    def _orders(self, tokens: list[int]) -> range:
        """The n-gram lengths to look up, longest first."""
        return range(min(self.ngram_max, len(tokens) - 1), self.ngram_min - 1, -1)

    def propose(self, ctx: ProposalContext, k: int) -> Draft:
        if self._match is None or k <= 0:
            return Draft([])
        follow, _ = self._match
        return Draft(ctx.tokens[follow : follow + k])

    def propose_tree(self, ctx: ProposalContext, depth: int, budget: int) -> DraftTree:
        """A trie of what followed the suffix's latest occurrences (longest n-grams
        first), so a verify tries several earlier continuations at once. The first match
        is the line the policy already sized (score 1: kept whole); an older, less
        specific match scores its prior acceptance per token to the power of its depth,
        shared down by its rank, so it is kept only where it pays."""
        tokens, paths, scores, starts = ctx.tokens, [], [], set()
        for n in self._orders(tokens):
            for follow in reversed(self._follow.get(tuple(tokens[len(tokens) - n :]), [])):
                path = tokens[follow : follow + depth]
                if follow in starts or not path:
                    continue
                starts.add(follow)
                rate = PRIORS[bucket(_match_length(tokens, follow, n))]
                share = 1.0 / (1 + len(paths))
                first = not paths
                paths.append(path)
                scores.append([1.0 if first else share * rate ** (j + 1) for j in range(len(path))])
        return keep_best(from_paths(paths[:RECENT], scores[:RECENT]), budget)


def _match_length(tokens: list[int], follow: int, n: int) -> int:
    """How far the match of the last n tokens ending before `follow` extends backwards."""
    length = n
    while (
        length < MATCH_BUCKETS[-1]
        and follow - length - 1 >= 0
        and tokens[follow - length - 1] == tokens[len(tokens) - length - 1]
    ):
        length += 1
    return length
