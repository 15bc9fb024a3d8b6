"""Training a block drafter (DFlash layout) on the cached teacher data (`data.py`).

The data holds the target's final-normed hidden state at every position, so our block
drafter reads that one feature: the last layer's output (target_layer_ids [N-1]) after
the final norm. `fc` is followed by `hidden_norm`, which ignores a row's scale, so the
final norm's weight folds into `fc`'s columns when saving and the checkpoint is an
ordinary z-lab DFlash one that reads the raw output of layer N-1.

Loss: a window of every batch row is cut at ANCHORS random anchor positions; each
anchor's block [token at the anchor, mask, ...] attends the context before the anchor
and its own block, all anchors in one pass, and slot j learns the teacher's
distribution of the token j after the anchor (KL over the draft vocabulary, as the
other drafters). Held-out agreement: per slot, the share of answer positions where
slots 1..j all equal the target's own greedy choices.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache
from mlx_lm.models.rope_utils import initialize_rope

from mlxspec.drafter.block import CONFIG, DFLASH, BlockDrafter, BlockSpec
from mlxspec.drafter.data import Shard
from mlxspec.drafter.head import lm_rows
from mlxspec.drafter.train import Batch, HeldOutChoices, held_out, sparse_kl
from mlxspec.models.anatomy import Decoder

BLOCK_SIZE = 8  # 7 drafts a pass: the head's useful depth on SmolLM2 is 3-4
ANCHORS = 8  # blocks trained per window row
# Held-out anchors: every 4th answer position (on SmolLM2 all of them took minutes a
# measure on a loaded 2-core CPU, out of the training budget).
EVAL_STRIDE = 4
WEIGHTS = "model.safetensors"
ROPE_THETA = 10000.0


def build_block(decoder: Decoder, layers: int = 1) -> BlockDrafter:
    """A fresh DFlash-layout drafter for `decoder`'s target: its layers start as copies
    of the target's last ones where the shapes allow, `fc` as the identity."""
    last = decoder.layers[-1].self_attn
    d = decoder.width
    heads, kv_heads = last.n_heads, last.n_kv_heads
    head_dim = last.q_proj.weight.shape[0] // heads
    spec = BlockSpec(
        format=DFLASH,
        block_size=BLOCK_SIZE,
        mask_token_id=decoder.embed.weight.shape[0] - 1,
        target_layer_ids=(len(decoder.layers) - 1,),
        hidden_size=d,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=decoder.layers[-1].mlp.gate_proj.weight.shape[0],
        norm_eps=1e-5,
        windows=(None,) * layers,
        causal=(False,) * layers,
    )
    drafter = BlockDrafter(spec, decoder.embed.weight.shape[0], _rope(head_dim))
    drafter.fc.weight = mx.eye(d)
    for mine, theirs in zip(drafter.layers, decoder.layers[-layers:]):
        source = dict(tree_flatten(theirs.parameters()))
        fits = [
            (name, source[name].astype(mx.float32))
            for name, value in tree_flatten(mine.parameters())
            if name in source and source[name].shape == value.shape
        ]
        mine.load_weights(fits, strict=False)
    return drafter


def _rope(head_dim: int) -> nn.Module:
    return initialize_rope(head_dim, base=ROPE_THETA, traditional=False)


class _Context:
    """A layer's context keys and values shared by every anchor of a row (the cache
    interface `Attention` reads)."""

    def __init__(self, keys: mx.array, values: mx.array):
        self.keys, self.values, self.offset = keys, values, keys.shape[2]

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        return self.keys, self.values


def anchored_hidden(
    drafter: BlockDrafter, decoder: Decoder, batch: Batch, anchors: mx.array
) -> mx.array:
    """The drafting slots' outputs (B * A, block - 1, d) of blocks at `anchors` (B, A):
    each block sees the context before its anchor and itself, as when drafting."""
    B, W = batch.tokens.shape
    A, size = anchors.shape[1], drafter.spec.block_size
    context = drafter.hidden_norm(drafter.fc(batch.hidden))
    contexts = []
    for layer in drafter.layers:
        cache = KVCache()
        layer.self_attn.add_context(context, 0, cache)
        keys, values = cache.keys_and_values()
        contexts.append(_Context(mx.repeat(keys, A, axis=0), mx.repeat(values, A, axis=0)))
    starts = anchors.reshape(-1)
    first = mx.take_along_axis(batch.tokens, anchors, axis=1).reshape(-1, 1)
    blocks = mx.concatenate([first, mx.full((B * A, size - 1), drafter.spec.mask_token_id)], 1)
    seen = mx.arange(W)[None] < starts[:, None]  # context before each anchor
    mask = mx.concatenate([seen, mx.ones((B * A, size), mx.bool_)], axis=1)[:, None, None]
    return drafter.block_hidden(blocks, starts, contexts, decoder, mask)


class BlockStudent:
    """A DFlash-layout block drafter as a training `Student`."""

    checkpoint = "checkpoint-block"

    def __init__(self, drafter: BlockDrafter, decoder: Decoder, vocab: mx.array, seed: int = 0):
        self.module, self.decoder, self.vocab = drafter, decoder, vocab
        self.rows = lm_rows(decoder, vocab)
        mx.eval(self.rows)
        self.choices = HeldOutChoices(decoder)
        self.rng = np.random.default_rng(seed)

    @property
    def layers(self) -> int:
        return self.module.spec.layers

    def loss(self, drafter: BlockDrafter, batch: Batch, done: float = 0.0) -> mx.array:
        B, W = batch.tokens.shape
        drafts = drafter.spec.block_size - 1
        anchors = mx.array(self.rng.integers(1, max(2, W - drafts), size=(B, ANCHORS)))
        h = anchored_hidden(drafter, self.decoder, batch, anchors)
        logits = h @ self.rows.T  # (B * A, drafts, vocab)
        # Draft j (from 0) is the token at anchor + j + 1: the teacher's distribution at
        # position anchor + j.
        where = anchors.reshape(-1, 1) + mx.arange(drafts)[None]  # (B * A, drafts)
        rows = mx.repeat(mx.arange(B), ANCHORS)[:, None]
        inside = where < W
        where = mx.minimum(where, W - 1)
        kl = sparse_kl(logits, batch.top_ids[rows, where], batch.top_logp[rows, where])
        valid = batch.mask[rows, where] * inside
        return (kl * valid).sum() / mx.maximum(valid.sum(), 1)

    def agreement(self, shards: list[Shard]) -> dict:
        """Per slot j, the share of held-out answer positions where slots 1..j all draft
        the target's own greedy tokens; and the accepted drafts per block (their sum)."""
        drafts = self.module.spec.block_size - 1
        hits, anchors_seen = np.zeros(drafts), 0
        for (tokens, hidden, prompt_length), chosen in zip(held_out(shards), self.choices(shards)):
            W = len(tokens)
            anchors = np.arange(max(prompt_length - 1, 1), W)[::EVAL_STRIDE]  # answer tokens
            if not len(anchors):
                continue
            batch = Batch(
                mx.array(tokens[None]),
                mx.array(hidden[None]).astype(mx.float32),
                mx.ones((1, W)),
                mx.zeros((1, W, 1), mx.int32),
                mx.zeros((1, W, 1)),
            )
            h = anchored_hidden(self.module, self.decoder, batch, mx.array(anchors[None]))
            guesses = np.asarray(self.vocab[mx.argmax(h @ self.rows.T, axis=-1)])
            # Draft j (from 0) at anchor p is the token at p + j + 1: the target's choice
            # after position p + j.
            right = np.zeros((len(anchors), drafts), bool)
            for j in range(drafts):  # drafts past the sequence's end count as refused
                usable = anchors + j < W
                right[usable, j] = guesses[usable, j] == chosen[anchors[usable] + j]
            hits += np.logical_and.accumulate(right, axis=1).sum(axis=0)
            anchors_seen += len(anchors)
        rates = [round(float(h / max(anchors_seen, 1)), 4) for h in hits]
        return {
            "first_token_acceptance": rates[0],
            "by_slot": rates,
            "accepted_per_block": round(sum(rates), 3),
            "positions": anchors_seen,
        }


def save_block(drafter: BlockDrafter, decoder: Decoder, directory: Path, record: dict) -> None:
    """The drafter as a z-lab DFlash checkpoint (config.json + model.safetensors): the
    target's final-norm weight folded into `fc`, so it reads layer N-1's raw output."""
    directory.mkdir(parents=True, exist_ok=True)
    spec = drafter.spec
    weights = {k: v.astype(mx.float16) for k, v in tree_flatten(drafter.parameters())}
    norm = decoder.norm.weight.astype(mx.float32)
    weights["fc.weight"] = (drafter.fc.weight * norm[None]).astype(mx.float16)
    tmp = directory / f".{WEIGHTS}.tmp.safetensors"
    mx.save_safetensors(str(tmp), weights)
    tmp.replace(directory / WEIGHTS)
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "rms_norm_eps": spec.norm_eps,
        "rope_theta": ROPE_THETA,
        "vocab_size": decoder.embed.weight.shape[0],
        "block_size": spec.block_size,
        "num_target_layers": len(decoder.layers),
        "dflash_config": {
            "mask_token_id": spec.mask_token_id,
            "target_layer_ids": list(spec.target_layer_ids),
        },
        "mlxspec_training": record,
    }
    (directory / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
