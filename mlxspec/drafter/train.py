"""Training drafters on cached teacher data (see `data.py`).

One loop (`train`) fits any `Student`: the head below, a small draft model
(`distill.py`) or an exit head for self-speculation (`exit.py`). Each brings its own
loss against the teacher's distribution and its own held-out agreement measure.

Head loss per position i (the head sees h_i and x_{i+1}, and guesses h_{i+1}):
KL(teacher || head) over the draft vocabulary, where the teacher's logits are the
target's LM head rows applied to h_{i+1} (kept as its top 32 tokens, worked out once
per run: see `teacher_top`), plus a small smooth-L1 pull of the head's
features towards h_{i+1} (EAGLE's feature loss), which is what lets later draft steps
feed them back in place of the target's hidden state. Late in the run the loss also
covers draft steps 2 and 3, each fed the head's own step before (EAGLE-3's
training-time test; see `HeadStudent`).

The budget is wall-clock minutes; the learning rate follows a cosine over it. A
checkpoint (weights, optimizer state, progress) is written every few minutes and a run
with the same output folder resumes from it.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from mlxspec.drafter.data import Shard
from mlxspec.drafter.head import DraftHead, head_cache, lm_rows
from mlxspec.models.anatomy import Decoder

CHECKPOINT = "checkpoint"
EVAL_POSITIONS = 64 * 150  # held-out answer positions an agreement measure reads (about)
TEACHER_TOP = 32  # teacher tokens kept per position: 0.96 of its mass on answers, 0.89 on docs


@dataclass
class TrainSettings:
    budget_minutes: float = 30.0
    # Self-distilled sequences (a prompt and <= 128 answer tokens) average 158 tokens, so
    # windows of 160 are ~99% real positions where 256 were 67%. Measured on SmolLM2 (2-core
    # CPU): 1,233 real positions/s at 13 x 160 vs 617 at 8 x 256 (1.7 s vs 2.2 s a step).
    batch: int = 13
    window: int = 160
    learning_rate: float = 1e-3
    warmup_steps: int = 50
    feature_weight: float = 0.1  # heads: smooth-L1 on g vs the next hidden state
    unroll: int = 3  # heads: draft steps trained as drafted (EAGLE-3's training-time test)
    unroll_from: float = 0.75  # ... from this share of the budget on (it costs ~unroll x)
    eval_every_seconds: float = 120.0
    checkpoint_every_seconds: float = 300.0
    seed: int = 0
    max_steps: int | None = None  # stop after this many steps too (tests: reproducible)


class Student(Protocol):
    """What `train` fits: a module whose trainable parameters are learnt, a loss on a
    batch of teacher data, and held-out greedy agreement with the target."""

    module: nn.Module
    checkpoint: str  # folder under OUT: a run resumes only a run of the same kind

    rows: mx.array  # the target's LM-head rows of the draft vocabulary: the teacher's

    def loss(self, module: nn.Module, batch: Batch, done: float = 0.0) -> mx.array:
        """`done`: the share of the budget spent (a head unrolls late in the run)."""
        ...

    def agreement(self, shards: list[Shard]) -> dict: ...


def check_layers(layers: int, total: int, what: str = "--layers", head: bool = False) -> None:
    """Drafters made of the target's first layers need at least one and fewer than all;
    a head's own layers, at most half as many as the target has (it must stay cheap)."""
    most = max(1, total // 2) if head else total - 1
    if not 1 <= layers <= most:
        kind = "a head's " if head else ""
        raise ValueError(
            f"{kind}{what} must be in 1..{most} for this {total}-layer target, got {layers}"
        )


@dataclass
class Progress:
    step: int = 0
    seconds: float = 0.0
    positions: int = 0
    curve: list[dict] = field(default_factory=list)  # held-out acceptance over time


def choose_vocab(shards: list[Shard], size: int, vocab_size: int, always: set[int]) -> mx.array:
    """The `size` ids the target itself emits most (answers count, prompts do not), plus
    `always` (end-of-text): as EAGLE-3 / FR-Spec do, a small draft vocabulary covers
    nearly every token a chat answer uses."""
    counts: Counter[int] = Counter()
    for shard in shards:
        for tokens, _, prompt_length in shard.sequences():
            counts.update(tokens[max(prompt_length, 1) :].tolist())
    chosen = [t for t in always if t < vocab_size]
    for token, _ in counts.most_common():
        if len(chosen) >= min(size, vocab_size):
            break
        if token not in always:
            chosen.append(token)
    for token in range(vocab_size):  # too little data: fill up with the lowest ids
        if len(chosen) >= min(size, vocab_size):
            break
        if token not in counts and token not in always:
            chosen.append(token)
    return mx.array(sorted(chosen), dtype=mx.int32)


def coverage(shards: list[Shard], vocab: mx.array) -> float:
    """Share of answer tokens that are in the draft vocabulary."""
    inside, total = 0, 0
    chosen = set(np.asarray(vocab).tolist())
    for shard in shards:
        for tokens, _, prompt_length in shard.sequences():
            answer = tokens[max(prompt_length, 1) :].tolist()
            inside += sum(t in chosen for t in answer)
            total += len(answer)
    return inside / max(total, 1)


def teacher_top(
    hidden: np.ndarray, rows: mx.array, k: int = TEACHER_TOP, chunk: int = 4096
) -> tuple[np.ndarray, np.ndarray]:
    """The teacher's k likeliest draft-vocabulary tokens at each position (indices into
    the draft vocabulary) and their log-probabilities renormalised over those k.

    Made once per training run: a full softmax over the draft vocabulary at every step
    was most of a step's time on a CPU, where `exp` is slow (MLX: ~30 ns a value)."""
    n = rows.shape[0]
    k = min(k, n)
    index_type = np.int16 if n <= np.iinfo(np.int16).max else np.int32
    ids_out, logp_out = [], []
    for start in range(0, len(hidden), chunk):
        logits = mx.array(hidden[start : start + chunk]).astype(mx.float32) @ rows.T
        if k < n:
            ids = mx.argpartition(-logits, k - 1, axis=-1)[:, :k]
        else:
            ids = mx.broadcast_to(mx.arange(n), logits.shape)
        top = mx.take_along_axis(logits, ids, axis=-1)
        logp = top - mx.logsumexp(top, axis=-1, keepdims=True)
        ids_out.append(np.asarray(ids).astype(index_type))
        logp_out.append(np.asarray(logp).astype(np.float16))
    if not ids_out:
        return np.zeros((0, k), index_type), np.zeros((0, k), np.float16)
    return np.concatenate(ids_out), np.concatenate(logp_out)


def sparse_kl(logits: mx.array, top_ids: mx.array, top_logp: mx.array) -> mx.array:
    """KL(teacher || student) at each position, the teacher known by its top tokens.

    The student's log-softmax is needed only at those tokens, so a step pays one
    logsumexp over the draft vocabulary instead of two softmaxes and an exp."""
    student = mx.take_along_axis(logits, top_ids, axis=-1)
    student = student - mx.logsumexp(logits, axis=-1, keepdims=True)
    return (mx.exp(top_logp) * (top_logp - student)).sum(-1)


@dataclass
class Batch:
    """Windows of training sequences, with the teacher's top tokens at each position
    (`teacher_top`; the distribution of the token after that position)."""

    tokens: mx.array  # (B, W) int32
    hidden: mx.array  # (B, W, d) float32
    mask: mx.array  # (B, W): 1 at real positions
    top_ids: mx.array  # (B, W, K) int32, indices into the draft vocabulary
    top_logp: mx.array  # (B, W, K) float32

    def kl(self, logits: mx.array, start: int = 0, stop: int | None = None) -> mx.array:
        """`sparse_kl` of the student's logits against positions start:stop."""
        return sparse_kl(logits, self.top_ids[:, start:stop], self.top_logp[:, start:stop])


class Batches:
    """Random windows of the training sequences, as fixed-shape arrays."""

    def __init__(self, shards: list[Shard], rows: mx.array, window: int, batch: int, seed: int):
        self.items = []
        for shard in shards:
            ids, logp = teacher_top(shard.hidden, rows)
            for s in range(len(shard.offsets) - 1):
                a, b = int(shard.offsets[s]), int(shard.offsets[s + 1])
                if b - a >= 3:
                    self.items.append((shard.tokens[a:b], shard.hidden[a:b], ids[a:b], logp[a:b]))
        if not self.items:
            raise ValueError("no training sequences; make data first")
        self.lengths = np.array([len(item[0]) for item in self.items], dtype=np.float64)
        self.window, self.batch = window, batch
        self.rng = np.random.default_rng(seed)

    def next(self) -> Batch:
        picks = self.rng.choice(len(self.items), self.batch, p=self.lengths / self.lengths.sum())
        _, h0, ids0, _ = self.items[0]
        shape = (self.batch, self.window)
        tokens = np.zeros(shape, np.int32)
        hidden = np.zeros((*shape, h0.shape[-1]), np.float16)
        top_ids = np.zeros((*shape, ids0.shape[-1]), np.int32)
        top_logp = np.zeros((*shape, ids0.shape[-1]), np.float16)
        mask = np.zeros(shape, np.float32)
        for row, i in enumerate(picks):
            t, h, ids, logp = self.items[i]
            start = int(self.rng.integers(0, max(1, len(t) - self.window + 1)))
            span = slice(start, start + min(self.window, len(t) - start))
            n = span.stop - span.start
            tokens[row, :n], hidden[row, :n], mask[row, :n] = t[span], h[span], 1
            top_ids[row, :n], top_logp[row, :n] = ids[span], logp[span]
        return Batch(
            mx.array(tokens),
            mx.array(hidden).astype(mx.float32),
            mx.array(mask),
            mx.array(top_ids),
            mx.array(top_logp).astype(mx.float32),
        )


def make_loss(decoder: Decoder, rows: mx.array, feature_weight: float, steps: int = 1):
    """The head's loss on a batch. With `steps` > 1, EAGLE-3's training-time test: draft
    steps 2..steps are run as the proposer runs them (`unroll`: fed the head's own
    output, attending its own earlier steps) and learn the teacher's distribution of the
    token s ahead, so later drafts are trained on what they will be fed. Step s weighs
    0.8^(s-1), as EAGLE-3 weighs them."""

    def loss_fn(model: DraftHead, batch: Batch):
        hidden = batch.hidden
        n = hidden.shape[1] - 2  # rows 0..n-1: drafting after position i+1
        pad = steps - 1  # steps s > 1 read teacher data s-1 positions past the window
        tokens, ids, logp, targets, mask = (
            _pad(a, pad) for a in (batch.tokens, batch.top_ids, batch.top_logp, hidden, batch.mask)
        )
        total = mx.array(0.0)
        for s, g in enumerate(unroll(model, decoder, tokens, hidden[:, :n], steps), 1):
            kl = sparse_kl(model.logits(g, rows), ids[:, s : s + n], logp[:, s : s + n])
            feature = nn.losses.smooth_l1_loss(
                model.features(g), mx.stop_gradient(targets[:, s : s + n]), reduction="none"
            ).mean(-1)
            valid = mask[:, s + 1 : s + 1 + n]  # the token step s predicts must exist
            per_position = kl + feature_weight * feature
            total = total + 0.8 ** (s - 1) * (per_position * valid).sum() / mx.maximum(
                valid.sum(), 1
            )
        return total

    return loss_fn


def _pad(a: mx.array, extra: int) -> mx.array:
    """`a` with `extra` zero positions appended along axis 1."""
    if not extra:
        return a
    widths = [(0, 0)] * a.ndim
    widths[1] = (0, extra)
    return mx.pad(a, widths)


def held_out(
    shards: list[Shard], positions: int = EVAL_POSITIONS
) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
    """Held-out sequences (tokens, hidden, prompt length) until about `positions` answer
    tokens: every kind of drafter is measured on the same ones."""
    seen = 0
    for shard in shards:
        for tokens, hidden, prompt_length in shard.sequences():
            if seen >= positions:
                return
            if len(tokens) >= 3:
                seen += len(tokens) - prompt_length
                yield tokens, hidden, prompt_length


def target_choices(decoder: Decoder, shards: list[Shard]) -> list[np.ndarray]:
    """The target's greedy choice after every position of each `held_out` sequence."""
    return [
        np.asarray(mx.argmax(decoder.head(mx.array(hidden).astype(mx.float32)), axis=-1))
        for _, hidden, _ in held_out(shards)
    ]


class HeldOutChoices:
    """`target_choices`, made once per set of held-out shards: the target does not change
    while a drafter trains, and on SmolLM2 working them out was 7.5 s of a head's 11 s
    held-out measure, taken every two minutes of the budget."""

    def __init__(self, decoder: Decoder):
        self.decoder = decoder
        self._shards: list[Shard] = []  # kept alive, so `is` below cannot see a new one
        self._choices: list[np.ndarray] = []

    def __call__(self, shards: list[Shard]) -> list[np.ndarray]:
        same = len(shards) == len(self._shards) and all(
            a is b for a, b in zip(shards, self._shards)
        )
        if not same:
            self._shards, self._choices = list(shards), target_choices(self.decoder, shards)
        return self._choices


def agreement(
    head: DraftHead,
    decoder: Decoder,
    rows: mx.array,
    shards: list[Shard],
    choices: list[np.ndarray] | None = None,
) -> dict:
    """Held-out first-draft acceptance under greedy decoding: how often the head's
    argmax equals the target's argmax (`choices`: `target_choices`), on answer tokens."""
    hits, totals = _accepted(head, decoder, rows, shards, 1, choices)
    share = round(float(hits[0] / max(totals[0], 1)), 4)
    return {"first_token_acceptance": share, "positions": int(totals[0])}


class _Stack:
    """A stand-in KV cache for drafting step s at every position at once: the keys and
    values of steps 1..s-1 with step s's appended; RoPE positions shifted by `offset`."""

    def __init__(self):
        self.keys = self.values = None
        self.offset = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if self.keys is not None:
            keys = mx.concatenate([self.keys, keys], axis=2)
            values = mx.concatenate([self.values, values], axis=2)
        self.keys, self.values = keys, values
        return keys, values


def unroll(head: DraftHead, decoder: Decoder, tokens: mx.array, hidden: mx.array, steps: int):
    """The head's outputs g of draft steps 1..steps at every row of a batch at once.

    Row i stands for drafting after position i (the target has seen tokens 0..i+1):
    step 1 reads h_i (`hidden`, (B, n, d)) and x_{i+1}; step s reads step s-1's output
    and x_{i+s} (`tokens` (B, >= n + steps): the true tokens, what the head is fed when
    the drafts before were right), sits at position i+s-1, and attends the target-made
    entries 0..i and its own earlier steps."""
    n = hidden.shape[1]
    cache = head_cache(head, _Stack)
    g = head(hidden, decoder.embed(tokens[:, 1 : n + 1]), "causal", cache)
    out = [g]
    mask, own = mx.tril(mx.ones((n, n), dtype=mx.bool_)), mx.eye(n, dtype=mx.bool_)
    for step in range(2, steps + 1):
        cache.offset = step - 1
        mask = mx.concatenate([mask, own], axis=1)
        g = head(head.feedback(g), decoder.embed(tokens[:, step : step + n]), mask, cache)
        out.append(g)
    return out


def draft_steps(head: DraftHead, decoder: Decoder, rows: mx.array, tokens, hidden, steps: int):
    """The head's draft logits (steps, L, n) at every position of one sequence (`unroll`)."""
    padded = mx.array(np.concatenate([tokens, np.zeros(steps, tokens.dtype)])[None])
    h = mx.array(hidden[None, :-2]).astype(mx.float32)
    return mx.stack([head.logits(g, rows)[0] for g in unroll(head, decoder, padded, h, steps)])


def acceptance_by_position(
    head: DraftHead,
    decoder: Decoder,
    rows: mx.array,
    shards: list[Shard],
    steps: int = 3,
    choices: list[np.ndarray] | None = None,
) -> list[float]:
    """Held-out greedy acceptance of draft tokens 1..steps: the share of answer
    positions where the head's first s drafts all equal the target's choices."""
    hits, totals = _accepted(head, decoder, rows, shards, steps, choices)
    return [round(float(h / max(t, 1)), 4) for h, t in zip(hits, totals)]


def _accepted(
    head: DraftHead,
    decoder: Decoder,
    rows: mx.array,
    shards: list[Shard],
    steps: int,
    choices: list[np.ndarray] | None,
) -> tuple[np.ndarray, np.ndarray]:
    """Per draft step s: held-out answer positions where drafts 1..s were all right, and
    positions measured (those whose token s ahead exists)."""
    hits, totals = np.zeros(steps), np.zeros(steps)
    choices = target_choices(decoder, shards) if choices is None else choices
    for (tokens, hidden, prompt_length), chosen in zip(held_out(shards), choices):
        n, start = len(tokens) - 2, max(prompt_length - 1, 0)  # rows predicting answer tokens
        logits = draft_steps(head, decoder, rows, tokens, hidden, steps)
        guesses = np.asarray(head.vocab[mx.argmax(logits, axis=-1)])
        truth = chosen[1:]  # the token after position i+1, which step 1 at row i drafts
        right = np.zeros((steps, n), bool)
        for s in range(steps):  # step s+1 at row i guesses the token after position i+s+1
            usable = min(n, len(truth) - s)  # rows whose token s+1 ahead exists
            right[s, :usable] = guesses[s, :usable] == truth[s : s + usable]
            totals[s] += max(usable - start, 0)
        hits += np.logical_and.accumulate(right, axis=0)[:, start:].sum(axis=1)
    return hits, totals


class HeadStudent:
    """A drafter head as a `Student` (the EAGLE-style loss and agreement above).

    Draft steps 2..unroll are trained as drafted (`make_loss`) only in the final part of
    the budget (`unroll_from`), as a step with 3 costs 3.2-3.6x on a CPU (measured at
    8 x 256 and 13 x 160). Measured on SmolLM2-135M, 8 more minutes for a trained head
    (held-out drafts 1/2/3 at 0.418/0.127/0.033) gave 0.414/0.155/0.061 unrolled,
    0.421/0.128/0.036 not."""

    checkpoint = CHECKPOINT

    def __init__(
        self,
        head: DraftHead,
        decoder: Decoder,
        feature_weight: float,
        unroll: int = 1,
        unroll_from: float = 0.0,
    ):
        self.module, self.decoder = head, decoder
        self.rows = lm_rows(decoder, head.vocab)
        mx.eval(self.rows)
        self.unroll, self.unroll_from = unroll, unroll_from
        self.losses = {s: make_loss(decoder, self.rows, feature_weight, s) for s in {1, unroll}}
        self.choices = HeldOutChoices(decoder)

    def loss(self, module: DraftHead, batch: Batch, done: float = 0.0) -> mx.array:
        return self.losses[self.unroll if done >= self.unroll_from else 1](module, batch)

    def agreement(self, shards: list[Shard]) -> dict:
        return agreement(self.module, self.decoder, self.rows, shards, self.choices(shards))

    def by_position(self, shards: list[Shard], steps: int = 3) -> list[float]:
        return acceptance_by_position(
            self.module, self.decoder, self.rows, shards, steps, self.choices(shards)
        )


def train(
    student: Student,
    train_shards: list[Shard],
    eval_shards: list[Shard],
    out: Path,
    settings: TrainSettings,
    report: Callable[[Progress, dict | None], None] = lambda progress, metrics: None,
) -> Progress:
    """Train `student.module` in place for the budget; resumes from its checkpoint."""
    module, folder = student.module, out / student.checkpoint
    budget = settings.budget_minutes * 60
    schedule = _Schedule(settings, budget)
    optimizer = optim.AdamW(learning_rate=settings.learning_rate, weight_decay=0.0)
    progress = _resume(module, optimizer, folder)
    batches = Batches(
        train_shards, student.rows, settings.window, settings.batch, settings.seed + progress.step
    )
    loss_and_grad = nn.value_and_grad(module, student.loss)

    def step(batch: Batch):
        loss, grads = loss_and_grad(module, batch, done=progress.seconds / budget)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        optimizer.update(module, grads)
        return loss

    if not progress.curve:
        progress.curve.append({"step": 0, "seconds": 0.0, **student.agreement(eval_shards)})
        report(progress, progress.curve[-1])
    # After the first measure, which may spend a while making its held-out inputs.
    last_eval = last_checkpoint = time.perf_counter()
    began, done_before = time.perf_counter(), progress.seconds
    losses: list[float] = []

    def finished() -> bool:
        steps_done = settings.max_steps is not None and progress.step >= settings.max_steps
        return steps_done or progress.seconds >= budget

    while not finished():
        optimizer.learning_rate = schedule(progress.step, progress.seconds)
        batch = batches.next()
        loss = step(batch)
        mx.eval(loss, module.parameters(), optimizer.state)
        losses.append(loss.item())
        progress.step += 1
        progress.positions += int(batch.mask.sum().item())
        progress.seconds = done_before + time.perf_counter() - began
        now = time.perf_counter()
        metrics = None
        if now - last_eval >= settings.eval_every_seconds or finished():
            metrics = {
                "step": progress.step,
                "seconds": round(progress.seconds, 1),
                "loss": round(float(np.mean(losses[-50:])), 4),
                **student.agreement(eval_shards),
            }
            progress.curve.append(metrics)
            last_eval = time.perf_counter()
        report(progress, metrics)
        if now - last_checkpoint >= settings.checkpoint_every_seconds:
            _save_checkpoint(module, optimizer, progress, folder)
            last_checkpoint = time.perf_counter()
    _save_checkpoint(module, optimizer, progress, folder)
    return progress


class _Schedule:
    """Linear warm-up, then a cosine over the wall-clock budget down to 10%."""

    def __init__(self, settings: TrainSettings, budget: float):
        self.settings, self.budget = settings, budget

    def __call__(self, step: int, seconds: float) -> float:
        warm = min(1.0, (step + 1) / self.settings.warmup_steps)
        done = min(1.0, seconds / self.budget)
        return self.settings.learning_rate * warm * (0.1 + 0.45 * (1 + math.cos(math.pi * done)))


def _save_checkpoint(module: nn.Module, optimizer, progress: Progress, folder: Path) -> None:
    """Only what is learnt: a draft model's frozen embedding would be most of it."""
    folder.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(module.trainable_parameters()))
    mx.save_safetensors(str(folder / "weights.safetensors"), weights)
    state = dict(tree_flatten(optimizer.state))
    mx.save_safetensors(str(folder / "optimizer.safetensors"), state)
    tmp = folder / ".progress.json.tmp"
    tmp.write_text(json.dumps(progress.__dict__))
    tmp.replace(folder / "progress.json")


def _resume(module: nn.Module, optimizer, folder: Path) -> Progress:
    if not (folder / "progress.json").is_file():
        return Progress()
    module.load_weights(list(mx.load(str(folder / "weights.safetensors")).items()), strict=False)
    optimizer.init(module.trainable_parameters())
    optimizer.state = tree_unflatten(list(mx.load(str(folder / "optimizer.safetensors")).items()))
    return Progress(**json.loads((folder / "progress.json").read_text()))
