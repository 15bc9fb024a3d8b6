"""A prefix array: every position of a token stream, sorted by the tokens read BACKWARDS
from it (at most MAX_MATCH of them, stopping at a document's start).

Why backwards: the earlier occurrences of the context's last m tokens are then one
contiguous range, and those of its last m + 1 tokens a sub-range of it, so the longest
match is found by narrowing one range a token at a time (a binary search over the
token at depth m), and each position's key never changes when tokens are appended
after it, so a new document is inserted without re-sorting the rest. Two int32 per
token (the stream and the order) make it compact enough to load from disk as is:
measured against a hashed n-gram pool in docs/design/suffix.md.

Documents are separated by SENTINEL (the stream starts with one, and a stored document
ends with one); no pattern contains
it, so a match never crosses from one document into another.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

SENTINEL = -1
MAX_MATCH = 32  # keys are compared this deep; longer matches count as this long


class PrefixIndex:
    """`tokens`: the stream (SENTINEL-separated documents); `order`: the positions of its
    real tokens sorted by backward key. Both int32."""

    def __init__(self, tokens: np.ndarray | None = None, order: np.ndarray | None = None):
        self.tokens = (
            np.array([SENTINEL], np.int32) if tokens is None else np.asarray(tokens, np.int32)
        )
        self.order = sort_positions(self.tokens) if order is None else np.asarray(order, np.int32)
        self._room: np.ndarray | None = None  # `append`'s spare room (`tokens` a view of it)
        self._view: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.order)

    @property
    def documents(self) -> int:
        return int(np.count_nonzero(self.tokens == SENTINEL)) - 1

    def key(self, position: int) -> list[int]:
        """The backward key of `position`, ending at (and including) a SENTINEL."""
        start = max(0, position - MAX_MATCH + 1)
        key = self.tokens[start : position + 1][::-1].tolist()
        if SENTINEL in key:
            del key[key.index(SENTINEL) + 1 :]
        return key

    def add_document(self, document: Sequence[int]) -> None:
        """Append a document; its positions are inserted in order (existing keys never
        change, so only the new ones need placing)."""
        if not document:
            return
        start = len(self.tokens)
        self.tokens = np.concatenate([self.tokens, np.array([*document, SENTINEL], dtype=np.int32)])
        self.insert_positions(range(start, len(self.tokens) - 1))

    def append(self, tokens: Sequence[int]) -> None:
        """Append tokens to the last document without indexing them (the request's own
        stream: a position is indexed once the token after it is known). Into spare room
        kept past the stream, doubled when full: a round's append copies its new tokens,
        not the stream (`tokens` is a view of the room; rebinding it elsewhere just
        costs one copy at the next append)."""
        size, extra = len(self.tokens), len(tokens)
        if not extra:
            return
        room = self._room
        if room is None or self.tokens is not self._view or size + extra > len(room):
            room = np.empty(max(2 * (size + extra), 64), np.int32)
            room[:size] = self.tokens
            self._room = room
        room[size : size + extra] = tokens
        self.tokens = self._view = room[: size + extra]

    def insert_positions(self, positions: Sequence[int]) -> None:
        new = sorted(positions, key=self.key)
        if not new:
            return
        if len(new) > 256 and len(new) > len(self.order) // 8:
            # Cheaper than placing each one; positions are indexed up to the newest.
            self.order = sort_positions(self.tokens[: max(new) + 1])
            return
        places = [self._place(self.key(p)) for p in new]
        self.order = np.insert(self.order, places, np.asarray(new, np.int32))

    def _place(self, key: list[int], depth: int = MAX_MATCH, after_equal: bool = True) -> int:
        """Where `key` goes in the order, comparing `depth` tokens: after equal keys, or
        before them."""
        lo, hi = 0, len(self.order)
        while lo < hi:
            mid = (lo + hi) // 2
            found = self.key(int(self.order[mid]))[:depth]
            if found < key or (after_equal and found == key):
                lo = mid + 1
            else:
                hi = mid
        return lo

    def longest_match(self, context: Sequence[int], limit: int = MAX_MATCH) -> tuple[int, int, int]:
        """(length, lo, hi): the longest m (at most `limit`) such that the context's last m
        tokens occurred before, and the range of the order holding where they ended.

        In a sorted order the key sharing the longest prefix with the context's own
        backward key is next to where that key would be inserted; then two binary
        searches bound the entries sharing that prefix. Three searches of whole keys,
        however repetitive the text (narrowing a token at a time costs a search per
        token: 5 ms on a stream of one repeated token)."""
        query = [int(t) for t in reversed(context[-min(limit, MAX_MATCH) :])]
        place = self._place(query)
        length = max(
            (
                _common_prefix(query, self.key(int(self.order[i])))
                for i in (place - 1, place)
                if 0 <= i < len(self.order)
            ),
            default=0,
        )
        if length == 0:
            return 0, 0, 0
        prefix = query[:length]
        lo = self._place(prefix, length, after_equal=False)
        hi = self._place(prefix, length)
        return length, lo, hi

    def occurrences(self, lo: int, hi: int, cap: int) -> np.ndarray:
        """Positions of a range, at most `cap` of them spread evenly over it (a fair
        sample of what followed), latest first."""
        if hi - lo > cap:
            picks = np.linspace(lo, hi - 1, cap).astype(np.int64)
            positions = self.order[picks]
        else:
            positions = self.order[lo:hi]
        return np.sort(positions)[::-1]

    def drop_oldest(self, keep_tokens: int) -> None:
        """Drop whole documents from the front until at most `keep_tokens` remain; keys of
        the kept positions do not reach back past their document's start, so the order
        stays sorted."""
        if len(self.tokens) <= keep_tokens:
            return
        starts = np.flatnonzero(self.tokens == SENTINEL)
        fits = starts[len(self.tokens) - starts <= keep_tokens]
        cut = int(fits[0]) if len(fits) else len(self.tokens)
        tokens = self.tokens[cut:]
        self.tokens = tokens if len(tokens) else np.array([SENTINEL], np.int32)
        kept = self.order[self.order > cut]
        self.order = (kept - cut).astype(np.int32)


def sort_positions(tokens: np.ndarray) -> np.ndarray:
    """The order of all real tokens by backward key, by prefix doubling: ranks of keys of
    length 2k from pairs of ranks of length k (numpy sorts, ~log2(MAX_MATCH) of them)."""
    n = len(tokens)
    # Ranks below n (SENTINEL, the smallest id, -> 0): a pair of ranks packs into one
    # int64 as rank * (n + 2) + rank without collisions, whatever the token ids.
    rank = np.unique(tokens, return_inverse=True)[1].astype(np.int64).reshape(-1)
    ended = tokens == SENTINEL  # the key of this length already reached a document start
    span = 1
    while span < MAX_MATCH:
        shifted = np.zeros(n, np.int64)
        shifted[span:] = rank[:-span]
        shifted[ended] = 0  # past a document's start nothing may order the key
        combined = rank * (n + 2) + shifted
        by_key = np.argsort(combined, kind="stable")
        ordered = combined[by_key]
        rank = np.empty(n, np.int64)
        rank[by_key] = np.cumsum(np.concatenate([[1], ordered[1:] != ordered[:-1]]))
        later = ended.copy()
        later[span:] |= ended[:-span]
        ended = later
        span *= 2
    by_key = np.argsort(rank, kind="stable")
    return by_key[tokens[by_key] != SENTINEL].astype(np.int32)


def _common_prefix(a: list[int], b: list[int]) -> int:
    length = 0
    for x, y in zip(a, b):
        if x != y:
            break
        length += 1
    return length
