"""Draft trees: many candidate continuations, verified in ONE target pass.

A tree's nodes are numbered as the verify pass sees them: node 0 is the pending token
(the root, already decided), nodes 1..n are draft tokens, each with a parent of a
smaller number. Nodes are kept in breadth-first order (depth never decreases with the
number), so nodes of one depth are contiguous: the verify applies RoPE per depth slice.

Acceptance walks from the root. Greedy: follow the child whose token is the target's
argmax at its parent. Sampling: at each node the children are candidates tried in
turn; the target's distribution at the node is p, candidate x is accepted with
probability p(x), else p loses x and is renormalised, and when every candidate has
failed the target's own token is drawn from what is left (SpecInfer's multi-candidate
rejection with one-hot candidates: the emitted token is distributed exactly as p,
however the candidates were chosen).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from mlxspec.sampling import sample_from


@dataclass(frozen=True)
class DraftTree:
    tokens: list[int]  # node i's token is tokens[i - 1] (node 0, the pending token, has none)
    parents: list[int]  # node i's parent is parents[i - 1], always < i
    # Each node's estimated chance to be accepted (product of draft confidences along its
    # path); it decides which nodes are worth their verify cost. None: keep every node.
    scores: list[float] | None = None

    def __post_init__(self) -> None:
        if len(self.parents) != len(self.tokens):
            raise ValueError("a draft tree needs one parent per token")
        for i, parent in enumerate(self.parents, start=1):
            if not 0 <= parent < i:
                raise ValueError(f"node {i} has parent {parent}; parents must come first")

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depths(self) -> list[int]:
        """Depth of every node, the root's (0) included."""
        depth = [0]
        for parent in self.parents:
            depth.append(depth[parent] + 1)
        return depth

    @property
    def is_chain(self) -> bool:
        return all(parent == i for i, parent in enumerate(self.parents))

    def path_tokens(self, node: int) -> list[int]:
        """Tokens from the root's first child down to `node`."""
        path = []
        while node:
            path.append(self.tokens[node - 1])
            node = self.parents[node - 1]
        return path[::-1]

    def children(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in range(len(self.tokens) + 1)]
        for i, parent in enumerate(self.parents, start=1):
            kids[parent].append(i)
        return kids


def chain(tokens: Sequence[int]) -> DraftTree:
    return DraftTree(list(tokens), list(range(len(tokens))))


def from_nodes(tokens: Sequence[int], parents: Sequence[int], scores: Sequence[float]) -> DraftTree:
    """A tree from nodes in any parent-first order, renumbered breadth-first and with
    duplicate siblings merged (a duplicate would only waste verify work)."""
    depth = [0]
    for parent in parents:
        depth.append(depth[parent] + 1)
    order = sorted(range(1, len(tokens) + 1), key=lambda i: (depth[i], i))
    new_index, seen = {0: 0}, {}
    out_tokens, out_parents, out_scores = [], [], []
    for old in order:
        parent = new_index[parents[old - 1]]
        key = (parent, tokens[old - 1])
        if key in seen:
            new_index[old] = seen[key]
            continue
        out_tokens.append(tokens[old - 1])
        out_parents.append(parent)
        out_scores.append(scores[old - 1])
        new_index[old] = seen[key] = len(out_tokens)
    return DraftTree(out_tokens, out_parents, out_scores)


def from_paths(paths: Sequence[Sequence[int]], scores: Sequence[Sequence[float]]) -> DraftTree:
    """A trie of token paths (e.g. prompt-lookup continuations); a node shared by several
    paths keeps its best score."""
    index: dict[tuple[int, ...], int] = {}
    tokens, parents, node_scores = [], [], []
    for path, path_scores in zip(paths, scores):
        parent = 0
        for depth, (token, score) in enumerate(zip(path, path_scores)):
            key = tuple(path[: depth + 1])
            if key not in index:
                tokens.append(token)
                parents.append(parent)
                node_scores.append(score)
                index[key] = len(tokens)
            node = index[key]
            node_scores[node - 1] = max(node_scores[node - 1], score)
            parent = node
    return from_nodes(tokens, parents, node_scores)


def keep_best(tree: DraftTree, n: int) -> DraftTree:
    """The n nodes of highest score, closed under ancestors (scores never rise along a
    path, so ties aside the best n already are; ancestors are added to be sure)."""
    if tree.scores is None or n >= len(tree):
        return tree
    ranked = sorted(range(1, len(tree) + 1), key=lambda i: (-tree.scores[i - 1], i))
    chosen: set[int] = set()
    for node in ranked:
        if len(chosen) >= n:
            break
        while node and node not in chosen:
            chosen.add(node)
            node = tree.parents[node - 1]
    keep = sorted(chosen)
    renumber = {0: 0, **{old: new for new, old in enumerate(keep, start=1)}}
    return DraftTree(
        [tree.tokens[i - 1] for i in keep],
        [renumber[tree.parents[i - 1]] for i in keep],
        [tree.scores[i - 1] for i in keep],
    )


def best_size(tree: DraftTree, verify_cost: Callable[[int], float]) -> int:
    """How many nodes to verify: the n maximising expected tokens per verify cost,
    (1 + sum of the n best scores) / verify(n + 1)."""
    if tree.scores is None:
        return len(tree)
    ranked = sorted(tree.scores, reverse=True)
    best_n, best_speed, expected = 0, 1.0, 1.0
    for n, score in enumerate(ranked, start=1):
        expected += score
        speed = expected / verify_cost(n + 1)
        if speed > best_speed:
            best_n, best_speed = n, speed
    return best_n


def node_sees(tree: DraftTree, width: int | None = None) -> np.ndarray:
    """Boolean (width, width), width at least n+1: node i sees node j where j is i or an
    ancestor of i. A column past the tree (padding) sees itself only."""
    size = len(tree) + 1
    width = size if width is None else width
    sees = np.eye(width, dtype=bool)
    for i, parent in enumerate(tree.parents, start=1):
        sees[i, :size] |= sees[parent, :size]
    return sees


def attention_mask(tree: DraftTree, offset: int) -> mx.array:
    """Boolean (n+1, offset+n+1): each node sees the cached prefix, its ancestors and itself."""
    sees = node_sees(tree)
    prefix = np.ones((len(sees), offset), dtype=bool)
    return mx.array(np.concatenate([prefix, sees], axis=1))


def batch_attention_mask(
    trees: Sequence[DraftTree], width: int, left_padding: Sequence[int], held: int
) -> mx.array:
    """Boolean (B, 1, width, held + width) for rows of a batch cache holding `held`
    columns, row i's first left_padding[i] of them padding: each node sees its row's
    cached tokens, its ancestors and itself."""
    columns = np.arange(held)[None, :]
    prefix = np.asarray(left_padding)[:, None] <= columns  # (B, held)
    masks = [
        np.concatenate([np.broadcast_to(row_prefix, (width, held)), node_sees(tree, width)], 1)
        for row_prefix, tree in zip(prefix, trees)
    ]
    return mx.array(np.stack(masks))[:, None]


def node_depths(trees: Sequence[DraftTree], width: int) -> np.ndarray:
    """(B, width): each row's node depths, padding columns at depth 0."""
    depths = np.zeros((len(trees), width), dtype=np.int32)
    for row, tree in enumerate(trees):
        tree_depths = tree.depths
        depths[row, : len(tree_depths)] = tree_depths
    return depths


def greedy_walk(tree: DraftTree, choices: Sequence[int]) -> tuple[list[int], int]:
    """(accepted nodes, root first excluded; the target's own next token) given the
    target's argmax at every node."""
    kids, node, path = tree.children(), 0, []
    while True:
        match = next((c for c in kids[node] if tree.tokens[c - 1] == choices[node]), None)
        if match is None:
            return path, choices[node]
        path.append(match)
        node = match


def sample_walk(
    tree: DraftTree, probs: np.ndarray, rng: np.random.Generator
) -> tuple[list[int], int]:
    """Multi-candidate rejection sampling down the tree; `probs` (n+1, V) are the
    target's sampling distributions at every node. Returns (accepted nodes, own token)."""
    kids, node, path = tree.children(), 0, []
    while True:
        p = probs[node].astype(np.float64)
        accepted = None
        for child in kids[node]:
            token = tree.tokens[child - 1]
            total = p.sum()
            if total > 0 and rng.random() * total < p[token]:
                accepted = child
                break
            p[token] = 0.0  # rejected: the rest of p, renormalised, is what remains
        if accepted is None:
            if p.sum() <= 0:  # every token with mass was a candidate, all refused by rounding
                p = probs[node]
            return path, sample_from(p, rng)
        path.append(accepted)
        node = accepted


class LevelGrower:
    """A draft tree grown level by level from per-node draft distributions: each node
    of a level offers its `branch` likeliest tokens as children, scored by the product
    of draft probabilities along the path (EAGLE-2's tree, shared by heads and block
    drafters)."""

    def __init__(self, branch: int):
        self.branch = branch
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.scores: list[float] = [1.0]  # scores[n] for node n (the root's is 1)
        self.paths: dict[int, list[int]] = {0: []}  # node -> its tokens from the root

    def grow(self, level: list[int], probs: mx.array) -> list[int]:
        """Children of the `level` nodes from their draft distributions (len(level), V)."""
        top = mx.argpartition(-probs, self.branch - 1, axis=-1)[:, : self.branch]
        chosen = mx.take_along_axis(probs, top, axis=-1)
        children = []
        for row, node in enumerate(level):
            for token, p in zip(top[row].tolist(), chosen[row].tolist()):
                if p > 0:
                    self.tokens.append(token)
                    self.parents.append(node)
                    self.scores.append(self.scores[node] * p)
                    self.paths[len(self.tokens)] = [*self.paths[node], token]
                    children.append(len(self.tokens))
        return children

    def best(self, nodes: list[int], n: int) -> list[int]:
        """The `n` likeliest of `nodes` (the next level to expand)."""
        return sorted(nodes, key=lambda node: -self.scores[node])[:n]

    def tree(self, budget: int) -> DraftTree:
        return keep_best(from_nodes(self.tokens, self.parents, self.scores[1:]), budget)
