"""Run an unmodified mlx-lm decoder over a token tree, and keep one path of it.

A tree verify needs two things a plain forward does not give: an attention mask where
each node sees only the prefix and its own ancestors, and RoPE positions that are a
node's depth rather than its index. Both go in through mlx-lm's own seams, so no
model file is forked:
- the mask: every attention layer asks its cache for one (`cache.make_mask`); during a
  tree forward the caches are wrapped in `TreeCache`, which answers with the tree mask;
- positions: each attention module's `rope(x, offset=cache.offset)` is swapped for
  `DepthRope`, which applies the model's own RoPE module per depth slice (nodes are in
  breadth-first order, so a depth is a contiguous slice), at offset + depth.
Afterwards `keep_nodes` moves the accepted path's KV entries into place and drops the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from mlxspec.models.tree import DraftTree, attention_mask


class DepthRope(nn.Module):
    """The model's RoPE applied at `offset + depth` to each depth slice of the nodes
    (with `base`, at `base + depth` whatever offset the caller passes)."""

    def __init__(self, rope: nn.Module, slices: list[tuple[int, int, int]], base: int | None):
        super().__init__()
        self.rope = rope
        self.slices = slices  # (start, stop, depth)
        self.base = base

    def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
        offset = offset if self.base is None else self.base
        parts = []
        for start, stop, depth in self.slices:
            # RoPE numbers a sequence's tokens consecutively; nodes of one depth share a
            # position, so each becomes a sequence of its own (length 1) for the call.
            part = x[..., start:stop, :]
            shape = part.shape
            flat = part.reshape(*shape[:-3], shape[-3] * shape[-2], 1, shape[-1])
            parts.append(self.rope(flat, offset=offset + depth).reshape(shape))
        return mx.concatenate(parts, axis=-2)


class NodeRope(nn.Module):
    """The model's RoPE applied at a position of its own to every (row, node) of a batch
    verify: `positions` (B, W). Rows' trees differ in shape, so no depth slice is shared;
    each (row, node) becomes a sequence of length 1 and `mx.fast.rope`'s per-sequence
    offsets carry the positions (the offset array mlx-lm's batch caches already pass)."""

    def __init__(self, rope: nn.Module, positions: mx.array):
        super().__init__()
        self.rope, self.positions = rope, positions

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        rows, heads, width, dims = x.shape
        flat = x.transpose(0, 2, 1, 3).reshape(rows * width, heads, 1, dims)
        flat = self.rope(flat, offset=self.positions.reshape(-1))
        return flat.reshape(rows, width, heads, dims).transpose(0, 2, 1, 3)


class TreeCache:
    """A KV cache that hands out the tree's attention mask; everything else is the
    wrapped cache's own."""

    def __init__(self, inner: KVCache, mask: mx.array):
        self.inner, self.mask = inner, mask

    def __bool__(self) -> bool:  # mlx-lm asks `if cache and hasattr(cache, "make_mask")`
        return True

    def make_mask(self, n: int, **_: Any) -> mx.array:
        return self.mask

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """Every module holding a `rope` (one per attention layer)."""
    return [m for _, m in model.named_modules() if isinstance(getattr(m, "rope", None), nn.Module)]


def unsupported_reason(model: nn.Module, cache: list[Any]) -> str | None:
    """Why tree verification cannot run on this model, or None when it can."""
    if not all(type(c) is KVCache for c in cache):
        kinds = sorted({type(c).__name__ for c in cache if type(c) is not KVCache})
        return f"its KV cache has layers of kind {', '.join(kinds)} (trees need plain KVCache)"
    if len(attention_modules(model)) != len(cache):
        return "its attention layers do not expose a RoPE module"
    return None


def depth_slices(tree: DraftTree) -> list[tuple[int, int, int]]:
    depths = tree.depths
    slices, start = [], 0
    for i in range(1, len(depths) + 1):
        if i == len(depths) or depths[i] != depths[start]:
            slices.append((start, i, depths[start]))
            start = i
    return slices


@contextmanager
def tree_positions(model: nn.Module, tree: DraftTree) -> Iterator[None]:
    """Within the block, the model's attention applies RoPE at the tree's depths."""
    with rope_positions(model, depth_slices(tree)):
        yield


@contextmanager
def rope_positions(
    model: nn.Module, slices: list[tuple[int, int, int]], base: int | None = None
) -> Iterator[None]:
    """Within the block, RoPE positions are given per slice (see DepthRope)."""
    with _ropes_replaced(model, lambda rope: DepthRope(rope, slices, base)):
        yield


@contextmanager
def node_positions(model: nn.Module, positions: mx.array) -> Iterator[None]:
    """Within the block, RoPE positions are given per (row, node) (see NodeRope)."""
    with _ropes_replaced(model, lambda rope: NodeRope(rope, positions)):
        yield


@contextmanager
def _ropes_replaced(model: nn.Module, replace: Callable[[nn.Module], nn.Module]) -> Iterator[None]:
    modules = attention_modules(model)
    originals = [m.rope for m in modules]
    try:
        for module, rope in zip(modules, originals):
            module.rope = replace(rope)
        yield
    finally:
        for module, rope in zip(modules, originals):
            module.rope = rope


def tree_caches(cache: list[KVCache], tree: DraftTree) -> list[TreeCache]:
    mask = attention_mask(tree, cache[0].offset)
    return [TreeCache(c, mask) for c in cache]


def keep_nodes(cache: list[KVCache], n_nodes: int, nodes: list[int]) -> None:
    """After a tree verify appended `n_nodes` entries (root first), keep those of `nodes`
    (node numbers, increasing, the root's 0 first) at the front, in that order."""
    for c in cache:
        base = c.offset - n_nodes
        index = mx.array(nodes) + base
        moved = len(nodes)
        c.keys[..., base : base + moved, :] = c.keys[..., index, :]
        c.values[..., base : base + moved, :] = c.values[..., index, :]
        c.offset = base + moved
    mx.eval([(c.keys, c.values) for c in cache])
