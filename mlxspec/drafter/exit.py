"""An exit head for self-speculation: the target's first L layers, then a learnt exit.

Raw layer-skip (the target's final norm and LM head applied after L of its layers)
rarely agrees with the target on small models: the last layers do real work. The exit
head is a residual MLP on the state after L layers whose output projection starts at
zero, then a copy of the target's final norm, then the target's LM head rows over the
draft vocabulary. Untrained, it is exactly raw layer-skip over that vocabulary; trained
(KL to the target's final distribution at the same position) it learns what the skipped
layers would have added. It has no attention, so it needs no KV cache: self-spec still
drafts inside the target's own cache.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from mlxspec.drafter.data import Shard
from mlxspec.drafter.head import lm_rows
from mlxspec.drafter.train import Batch, check_layers, held_out
from mlxspec.models.anatomy import Decoder

EXIT_FILE, EXIT_WEIGHTS = "exit.json", "exit.safetensors"
EXIT_PATTERNS = [EXIT_FILE, EXIT_WEIGHTS]
FORMAT = "mlxspec-exit-1"


class ExitError(ValueError):
    """An exit head that cannot be loaded or does not fit the target: one line."""


@dataclass
class ExitSpec:
    hidden_size: int
    vocab_size: int  # the target's
    layers: int  # it reads the target's state after this many layers
    adapter_size: int
    target: str = ""  # the models.toml name or reference it was made for
    norm_eps: float = 1e-5
    record: dict[str, Any] = field(default_factory=dict)  # how it was trained

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, **asdict(self)}


class ExitHead(nn.Module):
    def __init__(self, spec: ExitSpec, vocab: mx.array):
        super().__init__()
        d = spec.hidden_size
        self.spec = spec
        self.adapter_norm = nn.RMSNorm(d, eps=spec.norm_eps)
        self.up = nn.Linear(d, spec.adapter_size, bias=False)
        self.down = nn.Linear(spec.adapter_size, d, bias=False)
        self.norm = nn.RMSNorm(d, eps=spec.norm_eps)
        self._vocab = vocab  # draft-vocabulary ids in the target's vocabulary (not trained)

    @property
    def vocab(self) -> mx.array:
        return self._vocab

    def __call__(self, h: mx.array) -> mx.array:
        """What the LM head rows read, from the raw (un-normed) state after L layers."""
        return self.norm(h + self.down(nn.silu(self.up(self.adapter_norm(h)))))

    def logits(self, h: mx.array, rows: mx.array) -> mx.array:
        """Draft logits over the draft vocabulary; `rows` are the target LM head's rows."""
        return self(h) @ rows.T


def raw_states(decoder: Decoder) -> Decoder:
    """The same decoder without its final norm: `hidden` then gives the residual stream."""
    return replace(decoder, norm=nn.Identity())


def build_exit(
    decoder: Decoder, layers: int, vocab: mx.array, target: str = "", adapter_size: int = 0
) -> ExitHead:
    """A fresh exit head after `layers` layers that starts as raw layer-skip."""
    check_layers(layers, len(decoder.layers))
    d = decoder.width
    spec = ExitSpec(
        hidden_size=d,
        vocab_size=decoder.embed.weight.shape[0],
        layers=layers,
        adapter_size=adapter_size or 2 * d,
        target=target,
        norm_eps=float(getattr(decoder.norm, "eps", 1e-5)),
    )
    head = ExitHead(spec, vocab)
    head.norm.weight = mx.array(decoder.norm.weight).astype(mx.float32)
    head.down.weight = mx.zeros_like(head.down.weight)
    probe = mx.random.normal((1, 3, d), key=mx.random.key(0))
    if not mx.allclose(head(probe), decoder.norm(probe), atol=1e-4, rtol=1e-4):
        raise ExitError("exit heads need a target whose final norm is a plain RMSNorm")
    return head


def save_exit(head: ExitHead, directory: Path, dtype=mx.float16) -> None:
    """exit.safetensors (weights in `dtype`, plus the vocabulary ids) and exit.json."""
    directory.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(dtype) for k, v in tree_flatten(head.parameters())}
    weights["vocab"] = head.vocab.astype(mx.int32)
    tmp = directory / f".{EXIT_WEIGHTS}.tmp.safetensors"
    mx.save_safetensors(str(tmp), weights)
    tmp.replace(directory / EXIT_WEIGHTS)
    (directory / EXIT_FILE).write_text(json.dumps(head.spec.to_json(), indent=2) + "\n")


def load_exit(directory: Path, decoder: Decoder) -> ExitHead:
    """An exit head saved by `save_exit`, checked against the target's shape."""
    spec_file, weights_file = directory / EXIT_FILE, directory / EXIT_WEIGHTS
    if not spec_file.is_file() or not weights_file.is_file():
        raise ExitError(
            f"no exit head in {directory} (expected {EXIT_FILE} and {EXIT_WEIGHTS}, made by "
            "`mlxspec train-drafter --kind exit`)"
        )
    try:
        raw = json.loads(spec_file.read_text())
        if raw.pop("format", None) != FORMAT:
            raise ExitError(f"{spec_file} is not an mlxspec exit head ({FORMAT})")
        spec = ExitSpec(**raw)
        weights = mx.load(str(weights_file))
    except (OSError, TypeError, ValueError) as err:
        raise ExitError(f"cannot read the exit head in {directory}: {err}") from None
    d, vocab_size = decoder.width, decoder.embed.weight.shape[0]
    if (spec.hidden_size, spec.vocab_size) != (d, vocab_size):
        raise ExitError(
            f"the exit head in {directory} was made for a model of width {spec.hidden_size} "
            f"and vocabulary {spec.vocab_size}; this target has {d} and {vocab_size}"
            + (f" (it was trained for '{spec.target}')" if spec.target else "")
        )
    check_layers(spec.layers, len(decoder.layers), f"the layers of the exit head in {directory}")
    head = ExitHead(spec, weights.pop("vocab").astype(mx.int32))
    head.load_weights([(k, v.astype(mx.float32)) for k, v in weights.items()], strict=True)
    return head


class ExitStudent:
    """An exit head as a `Student` of `train`.

    Its input, the target's state after L layers, is recomputed for every batch from the
    stored tokens (teacher-forced, no gradient); the teacher is the target's final
    distribution at the same position, from the stored final hidden state.
    """

    def __init__(self, head: ExitHead, decoder: Decoder):
        self.module, self.decoder, self.layers = head, decoder, head.spec.layers
        self.checkpoint = f"checkpoint-exit-{self.layers}"
        self.raw = raw_states(decoder)
        self.rows = lm_rows(decoder, head.vocab)
        mx.eval(self.rows)
        self._held_out: list[tuple[mx.array, np.ndarray, int]] | None = None
        self.layer_skip_acceptance: float | None = None  # raw layer-skip, same positions

    def states(self, tokens: mx.array) -> mx.array:
        """The target's raw state after L layers (the layers stay frozen)."""
        return mx.stop_gradient(self.raw.hidden(tokens, [None] * self.layers, self.layers))

    def loss(self, module: ExitHead, batch: Batch, done: float = 0.0):
        kl = batch.kl(module.logits(self.states(batch.tokens), self.rows))
        return (kl * batch.mask).sum() / mx.maximum(batch.mask.sum(), 1)

    def _positions(self, shards: list[Shard]) -> list[tuple[mx.array, np.ndarray, int]]:
        """Held-out (state after L layers, target's greedy choice, answer start), made once
        (the layers are frozen), with raw layer-skip's agreement on the same positions."""
        if self._held_out is None:
            self._held_out, hits, total = [], 0, 0
            for tokens, hidden, prompt_length in held_out(shards):
                states = self.states(mx.array(tokens[None, :-1]))
                final = mx.array(hidden[None, :-1]).astype(mx.float32)
                truth = mx.argmax(self.decoder.head(final), axis=-1)
                skip = mx.argmax(self.decoder.head(self.decoder.norm(states)), axis=-1)
                mx.eval(states, truth, skip)
                start = max(prompt_length - 1, 0)
                same = np.asarray(skip == truth)[0, start:]
                hits, total = hits + int(same.sum()), total + len(same)
                self._held_out.append((states, np.asarray(truth)[0], start))
            self.layer_skip_acceptance = round(hits / max(total, 1), 4)
        return self._held_out

    def agreement(self, shards: list[Shard]) -> dict:
        """Held-out first-draft acceptance under greedy decoding, on answer tokens."""
        hits = total = 0
        for states, truth, start in self._positions(shards):
            guess = self.module.vocab[mx.argmax(self.module.logits(states, self.rows), axis=-1)]
            same = np.asarray(guess)[0, start:] == truth[start:]
            hits, total = hits + int(same.sum()), total + len(same)
        return {"first_token_acceptance": round(hits / max(total, 1), 4), "positions": total}
