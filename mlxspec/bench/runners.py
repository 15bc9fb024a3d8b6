"""One timed generation per call: mlx-lm's two loops and mlxspec's engine, timed alike.

Every runner starts from an empty KV cache (no prompt reuse between runs), stops at EOS
or `max_tokens`, detokenizes as it goes (as mlx-lm's stream_generate does, and as any
front end must), and reports the same `Measurement`:

- time to first token: start to the end of the first round (prefill included);
- decode rate: the tokens after the first round over the time after it. For plain
  decoding a round is one token, so this is "tokens after the first / time after the
  first"; for speculative loops the first round's accepted drafts leave with it, so
  they are not counted as free tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generate_step, speculative_generate_step

from mlxspec.decoding.engine import Engine, GenerationSettings
from mlxspec.events import Done, Event, Step
from mlxspec.structured.grammar import Constraint, Grammar, mask_processor

# How an mlxspec row runs a request: the engine's own stream, or (sharded) a rank
# session's, which keeps the ranks in step and times its collectives.
Stream = Callable[[list[int], GenerationSettings, str], Iterator[Event]]


@dataclass
class Measurement:
    tokens: list[int]  # the output, EOS excluded
    time_to_first_token: float
    first_round_tokens: int
    decode_seconds: float  # end of the first round to the end of the run
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0  # rounds that verified at least one draft
    tree_rounds: int = 0  # rounds verified as a branching tree (mlxspec @tree)
    tree_nodes: int = 0  # draft nodes verified in them
    accepted_lengths: list[int] = field(default_factory=list)  # rounds by drafts kept
    # Drafts of each round after the first (the rounds the decode rate times).
    round_drafts: list[int] = field(default_factory=list)
    estimated_speedup: float | None = None  # mlxspec's own estimate (see mlxspec/speedup.py)
    collective_seconds: float = 0.0  # sharded: waiting in mlxspec's per-round collectives
    collective_rounds: int = 0
    drafter_seconds: float = 0.0  # the proposer's own time (the run record's)
    total_seconds: float = 0.0  # the whole run, prefill included

    @property
    def decode_tokens(self) -> int:
        return max(len(self.tokens) - self.first_round_tokens, 0)

    @property
    def tokens_per_second(self) -> float | None:
        if self.decode_tokens == 0 or self.decode_seconds <= 0:
            return None  # finished within the first round: no decode rate to speak of
        return self.decode_tokens / self.decode_seconds


class Clock:
    """Round boundaries of one run, from which a Measurement's times follow."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first_round_end: float | None = None
        self.first_round_tokens = 0

    def round_done(self, n_tokens: int) -> None:
        if self.first_round_end is None:
            self.first_round_end = time.perf_counter()
            self.first_round_tokens = n_tokens

    def measurement(self, tokens: list[int], **counts: int) -> Measurement:
        end = time.perf_counter()
        first = self.first_round_end if self.first_round_end is not None else end
        return Measurement(
            tokens,
            first - self.start,
            self.first_round_tokens,
            end - first,
            total_seconds=end - self.start,
            **counts,
        )


def run_plain_mlx_lm(
    model: nn.Module,
    tokenizer,
    prompt: list[int],
    max_tokens: int,
    constraint: Constraint | None = None,
) -> Measurement:
    """mlx-lm's plain loop; with a constraint, every step masked by a logits processor
    (constrained plain decoding: the reference for a constrained row)."""
    eos, detokenizer = set(tokenizer.eos_token_ids), tokenizer.detokenizer
    detokenizer.reset()
    tokens: list[int] = []
    processors = [] if constraint is None else [mask_processor(constraint, len(prompt))]
    clock = Clock()
    steps = generate_step(
        mx.array(prompt), model, max_tokens=max_tokens, logits_processors=processors
    )
    for token, _ in steps:
        clock.round_done(1)
        if token in eos:
            break
        detokenizer.add_token(token)
        tokens.append(token)
    detokenizer.finalize()
    return clock.measurement(tokens)


def run_mlx_lm_speculative(
    model: nn.Module, draft: nn.Module, tokenizer, prompt: list[int], max_tokens: int, k: int
) -> Measurement:
    """mlx-lm's loop yields drafts it accepted (from_draft) then its own token per round."""
    eos, detokenizer = set(tokenizer.eos_token_ids), tokenizer.detokenizer
    detokenizer.reset()
    tokens: list[int] = []
    drafted = accepted = verify_steps = in_round = 0
    clock = Clock()
    steps = speculative_generate_step(
        mx.array(prompt), model, draft, num_draft_tokens=k, max_tokens=max_tokens
    )
    for token, _, from_draft in steps:
        if in_round == 0:  # mlx-lm drafted min(k, tokens left) for this round
            round_drafts = min(k, max_tokens - len(tokens))
            drafted += round_drafts
            verify_steps += round_drafts > 0
        in_round += 1
        accepted += from_draft
        finished = token in eos
        if not finished:
            detokenizer.add_token(token)
            tokens.append(token)
        if not from_draft or finished or len(tokens) >= max_tokens:
            clock.round_done(in_round)
            in_round = 0
        if finished:
            break
    detokenizer.finalize()
    return clock.measurement(tokens, drafted=drafted, accepted=accepted, verify_steps=verify_steps)


def run_mlxspec(
    engine: Engine,
    prompt: list[int],
    max_tokens: int,
    proposer: str,
    k: int | None,
    tree: bool = False,
    history: bool = False,
    stream: Stream | None = None,
    grammar: Grammar | None = None,
) -> Measurement:
    cold_start(engine)
    settings = GenerationSettings(
        max_tokens=max_tokens,
        k=k,
        context=len(prompt) + max_tokens,
        tree=tree,
        history=history,
        grammar=grammar,
    )
    clock = Clock()
    done, round_drafts = None, []
    for event in (stream or engine.stream)(prompt, settings, proposer):
        if isinstance(event, Step):
            if clock.first_round_end is not None:
                round_drafts.append(event.drafted)
            clock.round_done(event.accepted + 1)
        elif isinstance(event, Done):
            done = event
    record = done.record
    return clock.measurement(
        list(done.token_ids),
        drafted=record.drafted,
        accepted=record.accepted,
        verify_steps=record.verify_steps,
        tree_rounds=record.tree_rounds,
        tree_nodes=record.tree_nodes,
        accepted_lengths=record.accepted_lengths,
        round_drafts=round_drafts,
        estimated_speedup=record.speedup_estimate.value,
        collective_seconds=record.collective_seconds,
        collective_rounds=record.collective_rounds,
        drafter_seconds=record.drafter_seconds,
    )


def cold_start(engine: Engine) -> None:
    """Every mlxspec run prefills in full, like the mlx-lm runs, and starts with a fresh
    policy: the engine would otherwise reuse the previous run's prompt and acceptance."""
    engine.reset()
