"""`bench --synthetic-acceptance A`: the engine's speed at a known acceptance.

The proposer drafts the target's own next tokens, read from a plain greedy run of the
same prompt, and corrupts each drafted position with probability 1 - A
(proposers/synthetic.py). Drafting is free and its acceptance known, so what the
verify-cost curve predicts, E(k) / c(k + 1) with E(k) = (1 - A^(k+1)) / (1 - A), is
what an engine without overhead would reach; the measured speedup over plain decoding
(decode rates, same prompt, interleaved in one run) falls short of it by what a round
costs beyond its verify pass. Rows: each A by each k (a number, or adaptive).

The prediction's curve is timed at exactly the widths the rows verify (1 to k + 1: the
last rounds of an answer draft fewer; every width up to ADAPTIVE_K_MAX + 1 for adaptive
rows): the engine's curve interpolates between powers of two, and on this CPU's OpenBLAS
a 9-token pass costs 1.72 steps where the line from 8 (1.54) to 16 (1.83) says 1.58, a gap
that would read as overhead. It is timed after a context as long as the prompt and half
the answer, where the rounds run.

"Predicted for its rounds" prices the rounds the engine ran, each at the draft length it
drafted (the last rounds of an answer draft what is left; at the stop nothing), at the
measured acceptance: sum E(k_i) / sum c(k_i + 1). That is what an engine without overhead
reaches on the same rounds; the nominal prediction drafts k in every round (about 1 %
above it at k = 8 over 128 tokens, docs/design/synthetic-acceptance.md).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from typing import Any

from mlxspec.bench.runners import run_mlxspec
from mlxspec.bench.suites import BenchPrompt
from mlxspec.decoding.policy import expected_tokens
from mlxspec.decoding.verify_cost import VerifyCost, measure_verify_cost
from mlxspec.proposers.synthetic import SyntheticAcceptance
from mlxspec.registry.models_toml import NONE
from mlxspec.registry.runtime import Runtime

ACCEPTANCES = (0.5, 0.7, 0.9)
DRAFT_LENGTHS: tuple[int | None, ...] = (4, 8, None)  # None: adaptive
ADAPTIVE_K_MAX = 16  # the longest draft the adaptive rows may choose
SHORT_ANSWER_ROUNDS = 8  # fewer full rounds than this in a plain answer: a noisy row


def prediction_widths(draft_lengths: tuple[int | None, ...]) -> tuple[int, ...]:
    """The verify widths the rows run, and 1 (the unit), in increasing order."""
    widths = {1}
    for k in draft_lengths:
        widths.update(range(2, (ADAPTIVE_K_MAX if k is None else k) + 2))
    return tuple(sorted(widths))


def expected_speedup(cost: VerifyCost, acceptance: float, k: int | None) -> float:
    """Tokens per plain step the curve promises at per-token acceptance A for a draft of
    k (adaptive: the best k up to ADAPTIVE_K_MAX, or plain decoding's 1.0)."""
    if k is None:
        return max(
            [1.0] + [expected_speedup(cost, acceptance, j) for j in range(1, ADAPTIVE_K_MAX + 1)]
        )
    return expected_tokens(acceptance, k) / cost(k + 1)


def own_timings(ratios: list[float]) -> list[float]:
    """Each width priced by its own fastest timing, at least a step. The engine's fit (a
    running max) carries one slow timing to every wider width: with every width from 1 to
    9 timed, one busy moment at 4 tokens priced 5 to 9 tokens at 4.1 steps under load."""
    return [max(1.0, ratio) for ratio in ratios]


def rounds_speedup(cost: VerifyCost, acceptance: float, round_drafts: list[int]) -> float | None:
    """Tokens per plain step the curve promises for rounds that drafted `round_drafts`
    (one length a round) at per-token acceptance A: sum E(k_i) / sum c(k_i + 1)."""
    if not round_drafts:
        return None
    tokens = sum(expected_tokens(acceptance, k) for k in round_drafts)
    return tokens / sum(cost(k + 1) for k in round_drafts)


def synthetic_transcript(
    prompt: list[int], reference: list[int], max_tokens: int, stop: int | None
) -> list[int]:
    """What the proposer copies: the prompt and the plain answer, ended by the stop token
    where the answer stopped early, so that the last round drafts the stop too."""
    ends = stop is not None and len(reference) < max_tokens
    return [*prompt, *reference] + ([stop] if ends else [])


def run_synthetic(
    runtime: Runtime,
    prompts: list[BenchPrompt],
    max_tokens: int,
    repeats: int,
    notify: Callable[[str], None],
    acceptances: tuple[float, ...] = ACCEPTANCES,
    draft_lengths: tuple[int | None, ...] = DRAFT_LENGTHS,
) -> dict[str, Any]:
    """Per prompt: a plain reference run, then `repeats` rounds of plain and every
    (A, k), interleaved; rows are medians over prompts and repeats."""
    engine = runtime.engine
    engine.verify_cost  # noqa: B018  (the adaptive rows' curve, bounded and cached as always)
    # The prediction's curve: measured in full, now, in the same run as the rows (the
    # engine's own may be a budget's partial one, or cached from a calmer moment).
    notify("measuring the verify cost at the rows' widths for the predictions")
    first = engine.encode_chat([{"role": "user", "content": prompts[0].text}]) if prompts else []
    cost = measure_verify_cost(
        engine.target.model,
        engine.vocab_size,
        context=len(first) + max_tokens // 2,  # where the rounds run
        budget=None,
        order=prediction_widths(draft_lengths),
        fit=own_timings,
    )
    # Adaptive rows draft about 8 at these acceptances, rarely their ADAPTIVE_K_MAX.
    longest = max((k or 8) for k in draft_lengths)
    stop = next(iter(engine.tokenizer.eos_token_ids), None)
    runs: dict[tuple[float, int | None] | None, list[dict[str, Any]]] = {}
    total, done = len(prompts) * repeats * (1 + len(acceptances) * len(draft_lengths)), 0
    for index, prompt in enumerate(prompts):
        tokens = engine.encode_chat([{"role": "user", "content": prompt.text}])
        reference = run_mlxspec(engine, tokens, max_tokens, NONE, None).tokens  # also warms up
        if len(reference) < SHORT_ANSWER_ROUNDS * (longest + 1):
            notify(
                f"{prompt.id}: the plain answer is {len(reference)} tokens, a few rounds at "
                f"k = {longest}: its rows are noisy (prompts with longer answers, or a larger -n)"
            )
        transcript = synthetic_transcript(tokens, reference, max_tokens, stop)
        for repeat in range(repeats):
            plain = run_mlxspec(engine, tokens, max_tokens, NONE, None)
            runs.setdefault(None, []).append({"speed": plain.tokens_per_second})
            done += 1
            for acceptance in acceptances:
                for k in draft_lengths:
                    notify(
                        f"[{done + 1}/{total}] {prompt.id}: A = {acceptance}, k = {k or 'adaptive'}"
                    )
                    proposer = SyntheticAcceptance(
                        transcript,
                        acceptance,
                        engine.vocab_size,
                        seed=index * repeats + repeat,  # a draw of its own per run
                        k_max=k or ADAPTIVE_K_MAX,
                    )
                    engine.add_proposer(proposer)  # replaces the last one of that name
                    measured = run_mlxspec(engine, tokens, max_tokens, proposer.name, k)
                    runs.setdefault((acceptance, k), []).append(
                        {
                            "speed": measured.tokens_per_second,
                            "plain_speed": plain.tokens_per_second,
                            "kept": proposer.offered_kept,
                            "trials": proposer.offered_trials,
                            "drafted": measured.drafted,
                            "rounds": measured.verify_steps,
                            "round_drafts": measured.round_drafts,
                            "estimated": measured.estimated_speedup,
                            "match": measured.tokens == reference,
                        }
                    )
                    done += 1
    rows = [
        _row(acceptance, k, runs[(acceptance, k)], cost)
        for acceptance in acceptances
        for k in draft_lengths
    ]
    return {
        "rows": rows,
        "plain_tokens_per_second": _median([r["speed"] for r in runs[None]]),
        "verify_cost": {"points": cost.points, "step_seconds": cost.step_seconds},
        "engine_verify_cost": json.loads(engine.verify_cost.to_json()),
    }


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _row(
    acceptance: float, k: int | None, runs: list[dict[str, Any]], cost: VerifyCost
) -> dict[str, Any]:
    speedups = [r["speed"] / r["plain_speed"] for r in runs if r["speed"] and r["plain_speed"]]
    measured, expected = _median(speedups), expected_speedup(cost, acceptance, k)
    trials = sum(r["trials"] for r in runs)
    realised = sum(r["kept"] for r in runs) / trials if trials else None
    for_rounds = _median(
        [rounds_speedup(cost, realised, r["round_drafts"]) for r in runs]
        if realised is not None
        else []
    )
    return {
        "acceptance": acceptance,
        "k": k if k is not None else "adaptive",
        "measured_acceptance": realised,
        "mean_draft_length": sum(r["drafted"] for r in runs)
        / max(sum(r["rounds"] for r in runs), 1),
        "tokens_per_second": _median([r["speed"] for r in runs]),
        "speedup": measured,
        "expected_speedup": expected,
        "of_expected": measured / expected if measured is not None else None,
        # At the acceptance the corruption really gave (a short run's draw is noisy).
        "expected_at_measured": (
            expected_speedup(cost, realised, k) if realised is not None else None
        ),
        # The rounds the engine ran, each at its own draft length (`rounds_speedup`).
        "expected_for_rounds": for_rounds,
        "of_expected_for_rounds": (
            measured / for_rounds if measured is not None and for_rounds else None
        ),
        "estimated_speedup": _median([r["estimated"] for r in runs]),
        "token_match": all(r["match"] for r in runs),
    }


def synthetic_markdown(result: dict[str, Any]) -> str:
    """The rows as a table; 'of expected' is measured over what the curve predicts."""
    lines = [
        f"plain: {_number(result['plain_tokens_per_second'], '.1f')} tok/s",
        "",
        "| A | k | measured A | mean k | tok/s | speedup | curve predicts | of predicted "
        "| predicted at measured A | predicted for its rounds | of that "
        "| engine's estimate | tokens = plain |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['acceptance']} | {row['k']} | {_number(row['measured_acceptance'], '.2f')} "
            f"| {row['mean_draft_length']:.1f} | {_number(row['tokens_per_second'], '.1f')} "
            f"| {_number(row['speedup'], '.2f')}x | {row['expected_speedup']:.2f}x "
            f"| {_number(row['of_expected'], '.0%')} "
            f"| {_number(row['expected_at_measured'], '.2f')}x "
            f"| {_number(row['expected_for_rounds'], '.2f')}x "
            f"| {_number(row['of_expected_for_rounds'], '.0%')} "
            f"| {_number(row['estimated_speedup'], '.2f')}x "
            f"| {'yes' if row['token_match'] else 'NO'} |"
        )
    return "\n".join(lines)


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)
