"""Lookahead decoding (Fu et al. 2024): the target drafts for itself, no extra weights.

Each verify pass carries, beside the candidates being verified, a *lookahead branch*:
a window of W guessed future tokens hanging off the pending token. The target's
outputs at the window's nodes are one Jacobi iteration: guess i+1 becomes what the
target predicts after guesses 1..i. Iterated over rounds, the window converges towards
the target's own continuation, and every iteration leaves n-grams (N consecutive
tokens of the new guesses) in a pool keyed by their first token. Each round the pool's
n-grams that start with the pending token (up to G of them) are verified as a trie,
together with the window itself (Jacobi decoding's own guess).

This is the lookahead branch in its simplest, 2-level form (the paper keeps N-1 past
windows and harvests n-grams along their diagonals); the n-gram pool and the single
combined pass are the method. It spends W + G(N-1) extra tokens per verify: worth it
where a verify of many tokens costs little more than one (Metal), measured elsewhere.
"""

from __future__ import annotations

from collections import OrderedDict

from mlxspec.models.tree import DraftTree, from_nodes
from mlxspec.proposers.base import Draft, ProposalContext, Situation

POOL_PER_KEY = 8  # n-grams kept per first token (most recent wins)


class Lookahead:
    needs_hidden = False
    cost_hint = 0.0  # no drafter: its cost is the extra verified tokens (verify_nodes)
    always_tree = True  # the window rides along every verify, as a branch

    def __init__(self, name: str = "lookahead", window: int = 5, ngram: int = 4, guesses: int = 3):
        if window < 1 or ngram < 2 or guesses < 0:
            raise ValueError(
                f"lookahead needs window >= 1, ngram >= 2, guesses >= 0; got {window}, {ngram}, "
                f"{guesses}"
            )
        self.name, self.window, self.ngram, self.guesses = name, window, ngram, guesses
        self.k_max = max(window, ngram - 1)
        self.reset()

    def reset(self) -> None:
        self.pool: dict[int, OrderedDict[tuple[int, ...], None]] = {}
        self.guess: list[int] = []  # the window: guessed tokens after the pending one
        self._anchor: list[int] = []  # the sequence the window continues

    def verify_nodes(self, k: int) -> int:
        """Nodes a round verifies when the policy asks for depth k (for its cost)."""
        return self.window + self.guesses * (self.ngram - 1)

    def situation(self, ctx: ProposalContext) -> Situation | None:
        return Situation(self, "lookahead", prior=0.2)

    def _window(self, tokens: list[int]) -> list[int]:
        """The window for this sequence: the last one, shifted past what was accepted."""
        done = len(tokens) - len(self._anchor)
        if done < 0 or tokens[: len(self._anchor)] != self._anchor:
            guess = []
        else:
            guess = self.guess[done:]
        filler = guess[-1] if guess else tokens[-1]
        return (guess + [filler] * self.window)[: self.window]

    def propose(self, ctx: ProposalContext, k: int) -> Draft:
        """A line, for targets that cannot verify trees: the best pool n-gram, else the
        window (Jacobi decoding)."""
        window = self._window(ctx.tokens)
        self._anchor, self.guess = list(ctx.tokens), window
        found = self._candidates(ctx.tokens[-1])
        return Draft((list(found[0]) if found else window)[:k])

    def propose_tree(self, ctx: ProposalContext, depth: int, budget: int) -> DraftTree:
        window = self._window(ctx.tokens)
        tokens, parents = list(window), list(range(len(window)))
        for gram in self._candidates(ctx.tokens[-1])[: self.guesses]:
            parent = 0
            for token in gram[:depth]:
                tokens.append(token)
                parents.append(parent)
                parent = len(tokens)
        self._anchor, self.guess = list(ctx.tokens), window
        return from_nodes(tokens, parents, [1.0] * len(tokens))

    def _candidates(self, first: int) -> list[tuple[int, ...]]:
        return list(reversed(self.pool.get(first, {})))

    def verified(self, tree: DraftTree, choices: list[int]) -> None:
        """Take in the target's outputs at the window's nodes: the next Jacobi iterate,
        and its n-grams for the pool."""
        kids = tree.children()
        node, window_nodes = 0, []
        for token in self.guess:  # the window is the chain of the guesses from the root
            node = next((c for c in kids[node] if tree.tokens[c - 1] == token), None)
            if node is None:
                break
            window_nodes.append(node)
        # Outputs at the root and at the guesses verified: the next iterate's guesses.
        new = [choices[0], *(choices[n] for n in window_nodes)][: self.window]
        self.guess = new
        for start in range(len(new) - self.ngram + 1):
            gram = tuple(new[start : start + self.ngram])
            bucket = self.pool.setdefault(gram[0], OrderedDict())
            bucket.pop(gram[1:], None)
            bucket[gram[1:]] = None
            while len(bucket) > POOL_PER_KEY:
                bucket.popitem(last=False)
