"""Medusa heads (Cai et al. 2024, Medusa-1): K small heads on the target's last hidden
state, head k guessing the token k+1 places ahead, all at once, from one hidden row.

Head k is a residual block, h + SiLU(W_k h + b_k), read out through the target's own
LM head rows over a reduced draft vocabulary (as the EAGLE head does); W_k starts at
zero, so an untrained head repeats the target's next-token guess. The target stays
frozen. Trained on the same cached teacher data as the EAGLE head: hidden state h_t,
teacher distribution for head k = the target's at position t+k (its logits recomputed
from the stored h_{t+k}), loss = sum over k of 0.8^k KL(teacher || head).

Published Medusa checkpoints (FasterDecoding/Medusa: `medusa_lm_head.safetensors`,
keys `{k}.{j}.linear.{weight,bias}` for its j residual blocks and `{k}.{L}.weight` for
head k's own full-vocabulary LM head; `config.json` with medusa_num_heads and
medusa_num_layers) load into the same module.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from mlxspec.drafter.data import Shard
from mlxspec.drafter.head import HeadError, lm_rows
from mlxspec.drafter.train import Batch, HeldOutChoices, held_out
from mlxspec.models.anatomy import Decoder

WEIGHTS = "medusa.safetensors"
CONFIG = "medusa.json"
PUBLISHED = "medusa_lm_head.safetensors"
MEDUSA_PATTERNS = [WEIGHTS, CONFIG, PUBLISHED, "config.json"]  # what a hub download fetches
DECAY = 0.8  # loss weight of head k is DECAY**k: far guesses matter less


class ResBlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.linear = nn.Linear(d, d)
        self.linear.weight = mx.zeros_like(self.linear.weight)
        self.linear.bias = mx.zeros_like(self.linear.bias)

    def __call__(self, x: mx.array) -> mx.array:
        return x + nn.silu(self.linear(x))


class MedusaHeads(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        heads: int,
        vocab: mx.array,
        layers: int = 1,
        own_lm_heads: bool = False,
    ):
        super().__init__()
        self.blocks = [[ResBlock(hidden_size) for _ in range(layers)] for _ in range(heads)]
        if own_lm_heads:  # published checkpoints: one full LM head per Medusa head
            self.lm_heads = [
                nn.Linear(hidden_size, int(vocab.size), bias=False) for _ in range(heads)
            ]
        self._vocab = vocab
        self.layers = layers

    @property
    def vocab(self) -> mx.array:
        return self._vocab

    @property
    def count(self) -> int:
        return len(self.blocks)

    @property
    def own_lm_heads(self) -> bool:
        """Published heads carry their own LM heads and need no target rows."""
        return "lm_heads" in self

    def logits(self, hidden: mx.array, rows: mx.array) -> list[mx.array]:
        """Per head k, logits (..., n) over the draft vocabulary for the token k+1 ahead."""
        out = []
        for k, blocks in enumerate(self.blocks):
            x = hidden
            for block in blocks:
                x = block(x)
            out.append(self.lm_heads[k](x) if self.own_lm_heads else x @ rows.T)
        return out


def save_medusa(heads: MedusaHeads, directory: Path, record: dict | None = None) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(mx.float16) for k, v in tree_flatten(heads.parameters())}
    weights["vocab"] = heads.vocab
    mx.save_safetensors(str(directory / WEIGHTS), weights)
    config = {"kind": "medusa", "heads": heads.count, "layers": heads.layers}
    (directory / CONFIG).write_text(json.dumps({**config, **(record or {})}, indent=1))


def load_medusa(directory: Path, decoder: Decoder) -> MedusaHeads:
    """Our own saved heads, or a published Medusa checkpoint, for this target."""
    hidden_size = decoder.width
    vocab_size = decoder.embed.weight.shape[0]
    if (directory / WEIGHTS).is_file():
        config = json.loads((directory / CONFIG).read_text())
        weights = mx.load(str(directory / WEIGHTS))
        vocab = weights.pop("vocab")
        if int(vocab.max()) >= vocab_size:
            raise HeadError(f"{directory}: these Medusa heads were made for a larger vocabulary")
        heads = MedusaHeads(hidden_size, config["heads"], vocab, config["layers"])
    elif (directory / PUBLISHED).is_file():
        heads, weights = _published(directory, hidden_size, vocab_size)
    else:
        raise HeadError(f"{directory} holds no Medusa heads ({WEIGHTS} or {PUBLISHED})")
    try:
        heads.load_weights(list(weights.items()), strict=True)
    except ValueError as err:
        raise HeadError(f"{directory}: Medusa weights do not fit this target: {err}") from None
    return heads


def _published(directory: Path, hidden_size: int, vocab_size: int):
    config_file = directory / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    raw = mx.load(str(directory / PUBLISHED))
    count = config.get("medusa_num_heads") or 1 + max(int(k.split(".")[0]) for k in raw)
    layers = config.get("medusa_num_layers", 1)
    out_rows = raw.get(f"0.{layers}.weight")
    if out_rows is None or out_rows.shape != (vocab_size, hidden_size):
        raise HeadError(
            f"{directory}: a Medusa checkpoint for this target needs {count} heads of "
            f"[{vocab_size}, {hidden_size}] LM heads at '{{k}}.{layers}.weight'"
        )
    heads = MedusaHeads(hidden_size, count, mx.arange(vocab_size), layers, own_lm_heads=True)
    weights = {}
    for k in range(count):
        for j in range(layers):
            for part in ("weight", "bias"):
                weights[f"blocks.{k}.{j}.linear.{part}"] = raw[f"{k}.{j}.linear.{part}"]
        weights[f"lm_heads.{k}.weight"] = raw[f"{k}.{layers}.weight"]
    return heads, weights


class MedusaStudent:
    """Medusa heads as a training `Student`: the loss and held-out agreement above."""

    checkpoint = "checkpoint-medusa"

    def __init__(self, heads: MedusaHeads, decoder: Decoder):
        self.module = heads
        self.rows = lm_rows(decoder, heads.vocab)
        mx.eval(self.rows)
        self.choices = HeldOutChoices(decoder)

    def loss(self, heads: MedusaHeads, batch: Batch, done: float = 0.0):
        total, weight = mx.array(0.0), 0.0
        for k, logits in enumerate(heads.logits(batch.hidden, self.rows), start=1):
            if batch.hidden.shape[1] <= k:
                break
            kl = batch.kl(logits[:, :-k], k)  # the target's distribution k places later
            valid = batch.mask[:, k:]
            total = total + DECAY**k * (kl * valid).sum() / mx.maximum(valid.sum(), 1)
            weight += DECAY**k
        return total / weight

    def agreement(self, shards: list[Shard]) -> dict:
        """Held-out greedy agreement per head with the target's real choice k+1 ahead
        (answer positions only); head 1's is the first draft token's acceptance."""
        hits = np.zeros(self.module.count)
        totals = np.zeros(self.module.count)
        held = zip(held_out(shards), self.choices(shards))
        for (tokens, hidden, prompt_length), truth in held:  # truth: the token after t
            h = mx.array(hidden[None]).astype(mx.float32)
            start = max(prompt_length - 1, 0)
            for k, logits in enumerate(self.module.logits(h, self.rows), start=1):
                guess = self.module.vocab[mx.argmax(logits, axis=-1)][0]
                same = (np.asarray(guess[: len(tokens) - k]) == truth[k:])[start:]
                hits[k - 1] += same.sum()
                totals[k - 1] += len(same)
        rates = [round(float(h / max(t, 1)), 4) for h, t in zip(hits, totals)]
        return {"first_token_acceptance": rates[0], "by_head": rates, "positions": int(totals[0])}
