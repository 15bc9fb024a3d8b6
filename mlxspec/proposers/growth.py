"""Grow a draft tree from a drafter's next-token logits (EAGLE-2 style, best first).

The drafter is asked for the logits after a path of draft tokens; each such call is
one expansion. Expanding the node with the highest cumulative draft probability first
puts the work where the drafter is confident; every expansion adds the `branch` most
probable children, so siblings (the drafter's second and third guesses) come for free.
The cumulative probabilities are the nodes' scores, from which the engine keeps the
nodes worth their verify cost.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import mlx.core as mx

from mlxspec.models.tree import DraftTree, from_nodes, keep_best
from mlxspec.proposers.base import ProposalContext


def grow(
    ctx: ProposalContext,
    next_logits: Callable[[list[int]], mx.array],
    depth: int,
    budget: int,
    branch: int = 3,
    expansions: int | None = None,
) -> DraftTree:
    """A tree of at most `budget` nodes and `depth` levels. `next_logits(path)` gives
    the drafter's (1, V) logits after `ctx.tokens + path`. `expansions` caps the calls
    (default: depth + depth // 2: the main line plus a few side branches); the best
    `budget` of all the nodes they produce are kept."""
    limit = expansions if expansions is not None else depth + depth // 2
    tokens: list[int] = []
    parents: list[int] = []
    scores: list[float] = []
    paths: dict[int, list[int]] = {0: []}
    frontier = [(-1.0, 0)]  # (-score, node): nodes that may be expanded
    done = 0
    while frontier and done < limit:
        negative, node = heapq.heappop(frontier)
        path = paths[node]
        logits = next_logits(path)
        processed = ctx.scorer.process(logits, ctx.tokens + path, [])
        if ctx.scorer.settings.greedy:
            probs = mx.softmax(processed.astype(mx.float32), axis=-1)[0]
        else:
            probs = ctx.scorer.probabilities(processed)[0]
        top = mx.argpartition(-probs, branch - 1)[:branch]
        for token, p in sorted(zip(top.tolist(), probs[top].tolist()), key=lambda c: -c[1]):
            if p <= 0:
                break
            tokens.append(token)
            parents.append(node)
            scores.append(-negative * p)
            child = len(tokens)
            paths[child] = [*path, token]
            if len(paths[child]) < depth:
                heapq.heappush(frontier, (negative * p, child))
        done += 1
    return keep_best(from_nodes(tokens, parents, scores), budget)
