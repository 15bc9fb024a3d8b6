"""Shared checks for the lossless tests: plain reference, near-tie gaps, comparison.

The reference is mlx-lm's own `generate_step` (greedy), not mlxspec's k=0 path, so
the engine is checked against an independent implementation.

Tolerance rule: speculative tokens must equal the reference token for token. A
batched verify never rounds exactly like a one-token step, so a divergence is
tolerated only where the reference's own top-2 logit gap at that position is below
the device's near-tie bound (`sampling.near_tie_bound`: NEAR_TIE in float32, wider where
GEMMs run as TF32), which `test_verify_rounding_is_far_below_the_near_tie_bound`
justifies by measuring |batched - single-step| logits (10x below the bound). After a
tolerated divergence the comparison goes on: plain greedy is regenerated from the
prompt plus the speculative output up to and including the divergent token, so a
later bug in the same run still fails. Each tolerated divergence is reported with
`warnings.warn` (pytest's warnings summary shows it in CI output) and counted against
the caps below; where the engine's run record is given, it must have flagged the
near tie (`record.lossless` False).
"""

from __future__ import annotations

import warnings
from collections import Counter

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from mlxspec import device
from mlxspec.sampling import near_tie_bound

# The tiny test models' LM heads are scaled so that near ties are rare (a few in the
# whole suite, measured); two in one comparison, or many in a session, would mean the
# tolerance hides a rounding bug rather than forgiving float noise.
MAX_TOLERATED_PER_COMPARISON = 1
MAX_TOLERATED_PER_SESSION = 5  # distinct places: one near tie met by several proposers is one
tolerated_in_session: list[str] = []
tied_places: set[tuple] = set()  # (model, the context before the tie)


class NearTieWarning(UserWarning):
    """A speculative token that differs from plain greedy at a near tie (float noise)."""


class Reference(list):
    """Plain greedy tokens, remembering how they were made, so that they can be
    regenerated from a diverged prefix."""

    def __init__(self, tokens: list[int], max_tokens: int, eos: set[int]):
        super().__init__(tokens)
        self.max_tokens, self.eos = max_tokens, eos


def plain_greedy(model, prompt: list[int], max_tokens: int, eos: set[int]) -> Reference:
    out = []
    if max_tokens > 0:
        for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens):
            token = int(token)
            if token in eos:
                break
            out.append(token)
    return Reference(out, max_tokens, eos)


def top2_gap(model, tokens: list[int]) -> tuple[float, float]:
    """(gap between the best two next-token logits after `tokens`, one token at a time;
    the near-tie bound on this device for those logits)."""
    cache = make_prompt_cache(model)
    logits = None
    for token in tokens:
        logits = model(mx.array([[token]]), cache=cache)
    top = mx.sort(logits[0, -1])[-2:]
    bound = near_tie_bound(top[None], top.dtype, device.tf32_matmuls()).item()
    return (top[1] - top[0]).item(), bound


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (a length difference counts); None if equal."""
    if list(a) == list(b):
        return None
    common = min(len(a), len(b))
    return next((i for i in range(common) if a[i] != b[i]), common)


def assert_lossless(
    model, prompt: list[int], reference: Reference, got: list[int], label: str, record=None
) -> None:
    """Equal token for token, or diverging only at near ties of plain greedy (at most
    MAX_TOLERATED_PER_COMPARISON), each followed by an exact match of plain greedy
    regenerated from the diverged prefix. `record` (a RunRecord or its dict), where
    given, must have flagged any tolerated near tie."""
    got, tolerated = list(got), 0
    while (first := first_difference(reference, got)) is not None:
        gap, bound = top2_gap(model, prompt + got[:first])
        assert gap < bound, (
            f"{label}: speculative output diverges from plain greedy at token {first} where "
            f"the target's top-2 logit gap is {gap:.2e} (>= {bound:.2e}): a real bug\n"
            f"  plain: {reference[max(0, first - 3) : first + 3]}\n"
            f"  spec:  {got[max(0, first - 3) : first + 3]}"
        )
        tolerated += 1
        tolerated_in_session.append(f"{label} at token {first}")
        assert tolerated <= MAX_TOLERATED_PER_COMPARISON, (
            f"{label}: {tolerated} near-tie divergences in one output (at most "
            f"{MAX_TOLERATED_PER_COMPARISON}): rounding noise does not repeat like that"
        )
        tied_places.add((id(model), tuple(prompt + got[:first])))
        assert len(tied_places) <= MAX_TOLERATED_PER_SESSION, (
            f"near ties at {len(tied_places)} places in this session (at most "
            f"{MAX_TOLERATED_PER_SESSION}): {tolerated_in_session}"
        )
        if record is not None:
            lossless = record["lossless"] if isinstance(record, dict) else record.lossless
            assert not lossless, f"{label}: a near tie changed the output, yet lossless=True"
        warnings.warn(
            NearTieWarning(
                f"TOLERATED near tie: {label} at token {first}, top-2 gap {gap:.2e} < {bound:.2e}"
            ),
            stacklevel=2,
        )
        if first == len(got):  # speculation stopped (EOS) where plain went on: nothing after
            return
        kept = got[: first + 1]
        rest = plain_greedy(model, prompt + kept, reference.max_tokens - len(kept), reference.eos)
        reference = Reference(kept + rest, reference.max_tokens, reference.eos)


def assert_follows_law(seen: Counter, law: np.ndarray, label: str) -> None:
    """`seen` (how often each token was drawn) is a sample of `law` (probabilities by
    token id): chi-square over the tokens expected at least 5 times and the rest
    together, at about alpha 1e-4. The sampled counterpart of `assert_lossless`."""
    runs = sum(seen.values())
    likely = [t for t in range(len(law)) if law[t] * runs >= 5]
    observed = np.array([seen[t] for t in likely] + [runs - sum(seen[t] for t in likely)])
    expected = np.array([law[t] for t in likely] + [1 - law[likely].sum()]) * runs
    statistic = float(((observed - expected) ** 2 / expected).sum())
    dof = len(observed) - 1
    assert dof >= 3, f"{label}: the test model is too confident to test anything"
    assert statistic < dof + 4.5 * np.sqrt(2 * dof), (label, statistic, dof)
