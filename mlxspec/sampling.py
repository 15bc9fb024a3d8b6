"""Turn target/draft logits into decisions exactly as plain decoding would.

Greedy and sampled decoding share one pipeline, built from mlx-lm's own pieces:
logits processors (repetition, presence and frequency penalties) → log-softmax →
top-k / top-p masks → temperature. Draft and target distributions go through the same
pipeline, which is what makes rejection sampling reproduce the target's distribution
exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Protocol

import mlx.core as mx
import numpy as np

from mlxspec.device import tf32_matmuls

# Logit margin under which greedy choices are not guaranteed to match plain decoding: a
# batched verify (and a cache filled by one) rounds differently from one-token steps, by
# ~1e-5 on the models measured (tests/test_lossless.py keeps it 10x below this bound).
NEAR_TIE = 1e-3
# Half-precision logits (bf16/fp16, as Macs run most models) carry only 8-11 bits of
# mantissa, so two ways of summing the same products can land several units in the last
# place apart: there a tie is any gap within this many machine epsilons (relative to the
# larger logit; 1-2 ulps each). At logit 30 that is 7e-6 in fp32, so fp32 keeps NEAR_TIE,
# and 0.47 in bf16 (whose ulp there is 0.125). Not measured on Metal: no Mac here.
NEAR_TIE_EPS = 2
# Where float32 GEMMs run as TF32 (MLX's CUDA backend unless MLX_ENABLE_TF32=0,
# device.tf32_matmuls), a verify's GEMM inputs keep 10 mantissa bits while a one-token
# step's GEMV keeps 23. Rounding the batched pass's GEMM inputs to TF32 on the CPU
# (tests/tf32.py) moved the tiny test models' logits by up to 0.96 TF32 epsilons of the
# top logit (0.02 at logit 24): 16 epsilons keeps that 10x below the bound, as NEAR_TIE
# does for float32 (1.6% of the top logit: about 0.4 at logit 25).
TF32_EPS = 2.0**-10
TF32_NEAR_TIE_EPS = 16
# The widest penalty window: mlx-lm slices the history with it, and MLX's slice indices
# are 32-bit (a wider one fails mid-generation).
MAX_CONTEXT_SIZE = 2**31 - 1


@dataclass(frozen=True)
class SamplingSettings:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float | None = None
    repetition_context_size: int = 20
    # OpenAI's additive penalties with mlx-lm's semantics: minus presence_penalty for a
    # token among the last presence_context_size tokens (prompt included), minus
    # frequency_penalty for each time it occurs among the last frequency_context_size.
    # OpenAI counts the whole completion and never the prompt (docs/serving.md).
    presence_penalty: float = 0.0
    presence_context_size: int = 20
    frequency_penalty: float = 0.0
    frequency_context_size: int = 20
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.repetition_penalty is not None and self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        for name in ("repetition_context_size", "presence_context_size", "frequency_context_size"):
            if not 1 <= getattr(self, name) <= MAX_CONTEXT_SIZE:
                raise ValueError(
                    f"{name} must be from 1 to {MAX_CONTEXT_SIZE}, got {getattr(self, name)}"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def to_dict(self) -> dict:
        return asdict(self)


class TreePaths(Protocol):
    """What scoring a tree verify needs of a draft tree (mlxspec.models.tree.DraftTree): the tokens
    from the root to each node. A protocol, so this module stays below the tree that samples
    through it."""

    def path_tokens(self, node: int) -> list[int]: ...


class TokenScorer:
    """Applies the sampling settings to rows of logits.

    Row i of a verify pass predicts the token after `history + continuation[:i]`;
    history-dependent processors (the penalties) must see exactly that prefix.
    """

    def __init__(self, settings: SamplingSettings):
        self.settings = settings
        # mlx-lm's samplers load when one is built: importing mlx-lm loads transformers,
        # which the command line's launcher and `--help` never need (tests/test_imports.py).
        from mlx_lm.sample_utils import make_logits_processors

        self.tf32 = tf32_matmuls()  # a verify's GEMMs round coarser: a wider near tie
        self.processors = make_logits_processors(
            repetition_penalty=settings.repetition_penalty,
            repetition_context_size=settings.repetition_context_size,
            presence_penalty=settings.presence_penalty,
            presence_context_size=settings.presence_context_size,
            frequency_penalty=settings.frequency_penalty,
            frequency_context_size=settings.frequency_context_size,
        )

    def process(self, logits: mx.array, history: list[int], continuation: list[int]) -> mx.array:
        """Logits (m, V) → processed logits (m, V); m-1 <= len(continuation)."""
        return self.process_rows(logits, lambda i: history + continuation[:i])

    def process_tree(self, logits: mx.array, history: list[int], tree: TreePaths) -> mx.array:
        """Rows of a tree verify: row i follows the path from the root to node i."""
        return self.process_rows(logits, lambda i: history + tree.path_tokens(i))

    def process_rows(self, logits: mx.array, prefix: Callable[[int], list[int]]) -> mx.array:
        """Row i of `logits` follows the tokens `prefix(i)`."""
        if not self.processors:
            return logits
        rows = []
        for i in range(logits.shape[0]):
            seen = mx.array(prefix(i), mx.int32)
            row = logits[i : i + 1]
            for processor in self.processors:
                row = processor(seen, row)
            rows.append(row)
        return mx.concatenate(rows, axis=0)

    def greedy_tokens(self, processed: mx.array) -> list[int]:
        return mx.argmax(processed, axis=-1).tolist()

    def near_ties(self, processed: mx.array, rows: list[int]) -> int:
        """How many of `rows` have their best two logits within `near_tie_bound`: there
        rounding alone may make speculation pick another token than plain decoding."""
        return int(mx.sum(self.near_tie_rows(processed[mx.array(rows)])).item())

    def near_tie_rows(self, processed: mx.array, best: mx.array | None = None) -> mx.array:
        """Per row of `processed` (m, V), whether it is a near tie (lazy, (m,) bool).
        `best`: the rows' argmax (m,), where the caller computed it already."""
        top2 = top_two(processed, mx.argmax(processed, axis=-1) if best is None else best)
        bound = near_tie_bound(top2, processed.dtype, self.tf32)
        return mx.abs(top2[:, 1] - top2[:, 0]) < bound

    def probabilities(self, processed: mx.array) -> mx.array:
        """The distribution plain sampling draws from, as float32 rows (m, V)."""
        logprobs = processed.astype(mx.float32)
        logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
        vocab = logprobs.shape[-1]
        from mlx_lm.sample_utils import apply_top_k, apply_top_p  # loaded by __init__

        if 0 < self.settings.top_p < 1:
            logprobs = apply_top_p(logprobs, self.settings.top_p)
        if 0 < self.settings.top_k < vocab:
            logprobs = apply_top_k(logprobs, self.settings.top_k)
        return mx.softmax(logprobs * (1.0 / self.settings.temperature), axis=-1)


def top_two(rows: mx.array, best: mx.array) -> mx.array:
    """Each row's two largest values (m, 2), as `mx.topk(rows, 2)` gives them, from its
    argmax `best` (m,): the max once that column is masked. `mx.topk` partitions every
    row: over SmolLM2's 49152 columns it took 3-5x the time of this on this CPU, about
    2 % of a 9-token verify, in every speculative round (near ties are counted there)."""
    column = best[:, None]
    first = mx.take_along_axis(rows, column, axis=-1)
    masked = mx.put_along_axis(rows, column, mx.array(-mx.inf, rows.dtype), axis=-1)
    return mx.concatenate([first, masked.max(axis=-1, keepdims=True)], axis=-1)


def near_tie_bound(top: mx.array, dtype: mx.Dtype, tf32: bool = False) -> mx.array:
    """The logit gap below which a batched verify and one-token steps may disagree: NEAR_TIE
    (measured on fp32), or NEAR_TIE_EPS epsilons of the larger logit where the logits' own
    precision is coarser than that (half precision), or TF32_NEAR_TIE_EPS TF32 epsilons
    where float32 GEMMs run as TF32 (`tf32`)."""
    scale = mx.abs(top.astype(mx.float32)).max(axis=-1)
    if tf32 and dtype == mx.float32:
        return mx.maximum(NEAR_TIE, TF32_NEAR_TIE_EPS * TF32_EPS * scale)
    return mx.maximum(NEAR_TIE, NEAR_TIE_EPS * mx.finfo(dtype).eps * scale)


def sample_from(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Inverse-CDF draw from an unnormalised probability row."""
    cumulative = np.cumsum(probs, dtype=np.float64)
    index = int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"))
    return min(index, len(probs) - 1)


def rejection_sample(
    draft_tokens: list[int],
    draft_probs: np.ndarray | None,
    target_probs: np.ndarray,
    rng: np.random.Generator,
) -> tuple[int, int]:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

    Accept draft x_i with probability min(1, p_i(x)/q_i(x)); at the first rejection
    draw from norm(max(0, p_i - q_i)); after a full accept draw the bonus from p_k.
    `draft_probs` None means a deterministic proposer: q is one-hot on the draft.
    Returns (number of drafts accepted, the target's own next token).
    """
    for i, token in enumerate(draft_tokens):
        p_row = target_probs[i]
        q_token = 1.0 if draft_probs is None else float(draft_probs[i, token])
        if q_token > 0 and rng.random() * q_token < p_row[token]:
            continue
        if draft_probs is None:
            residual = p_row.astype(np.float64)
            residual[token] = 0.0
        else:
            residual = np.maximum(p_row.astype(np.float64) - draft_probs[i], 0.0)
        if residual.sum() <= 0:  # p == q up to rounding: any draw from p is exact
            residual = p_row
        return i, sample_from(residual, rng)
    return len(draft_tokens), sample_from(target_probs[len(draft_tokens)], rng)
