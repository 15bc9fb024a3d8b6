"""One request's decoding state and the per-round steps of the round loop.

The scheduler's round (batch/scheduler.py), for a batch and for `Engine.stream`'s
batch of one, keeps one `RequestRun` per request: its tokens, sampling rng and scorer,
policy, text stream and run record. Each round it hands it the verified logits; it
decides what to keep (greedy walk or rejection sampling) and turns the result into
events, so a request accepts and emits the same way alone and in a batch.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable, Iterator, Sequence

import mlx.core as mx
import numpy as np

from mlxspec.decoding.policy import Policy
from mlxspec.decoding.text import TextStream
from mlxspec.events import Accepted, Bonus, Corrected, Done, Event, Rejected, RunRecord, Step
from mlxspec.logprobs import PendingLogprobs, TokenLogprob, pending_logprobs
from mlxspec.models.kv_form import FLOAT
from mlxspec.models.tree import DraftTree, greedy_walk, sample_walk
from mlxspec.proposers.base import Draft, Proposer, Situation
from mlxspec.sampling import SamplingSettings, TokenScorer, rejection_sample
from mlxspec.structured.grammar import Constraint, masked_logits

EVENT_FOR_KIND = {"accepted": Accepted, "corrected": Corrected, "bonus": Bonus}


class RequestRun:
    def __init__(
        self,
        tokenizer,
        record: RunRecord,
        prompt_tokens: list[int],
        sampling: SamplingSettings,
        stop: Sequence[str],
        max_tokens: int,
        policy: Policy,
        proposer: Proposer | None,
        history: bool = True,
        top_logprobs: int | None = None,
        constraint: Constraint | None = None,
        min_indent: int = 0,
        line_seconds: float | None = None,
    ):
        self.tokenizer, self.record = tokenizer, record
        # The grammar the output must match, its state after every produced token.
        self.constraint = constraint
        if constraint is not None:
            record.grammar = constraint.grammar.describe()
        # Alternatives reported with each token's logprob (None: no logprobs at all).
        self.top_logprobs = top_logprobs
        self.history = history  # may proposers read, and the engine feed, the model's history?
        # Verified in a pass shared with other requests (the batch): even a plain round is
        # then not plain decoding (its row is padded to the others'), so it counts near ties.
        self.shared_pass = False
        self.prompt_tokens = list(prompt_tokens)
        self.policy, self.proposer = policy, proposer
        self.sampling, self.max_tokens = sampling, max_tokens
        seed = sampling.seed if sampling.seed is not None else random.randrange(2**31)
        record.sampling = {**sampling.to_dict(), "seed": seed}
        self.rng = np.random.default_rng(seed)
        self.scorer = TokenScorer(sampling)
        self.eos = set(tokenizer.eos_token_ids)
        self.text = TextStream(tokenizer, stop, min_indent)
        self.line_seconds = line_seconds
        self.sequence = list(prompt_tokens)  # ends with the pending token
        self.produced: list[int] = []  # generated, EOS excluded
        self.emitted: list[int] = []  # released as output: produced, cut at a stop string
        # Where asked for, one per token of `produced` and of `emitted`.
        self.produced_logprobs: list[TokenLogprob] = []
        self.emitted_logprobs: list[TokenLogprob] = []
        self.start = time.perf_counter()
        self.first_token_at: float | None = None
        self.finished: str | None = None

    @property
    def transcript(self) -> list[int]:
        """The prompt and what was generated (EOS excluded): what history keeps."""
        return [*self.prompt_tokens, *self.produced]

    @property
    def counts_near_ties(self) -> bool:
        """Whether its greedy rounds count near ties: a plain round alone is exact."""
        return self.proposer is not None or self.shared_pass

    @property
    def left(self) -> int:
        """Most drafts worth proposing: one token of every round is the target's own."""
        return self.max_tokens - len(self.produced) - 1

    def constrain(self, tree: DraftTree) -> tuple[DraftTree, np.ndarray | None, int | None]:
        """The round's draft cut to what the grammar allows, with the mask of each of
        the verify's rows (None without a grammar) and, for a line the grammar cut, the
        token it refused (rejection sampling against a drafter's q still owes that token
        its rejection: `accept`)."""
        if self.constraint is None:
            return tree, None, None
        kept, masks, refused = self.constraint.prune(tree.tokens, tree.parents)
        self.record.grammar_pruned += len(tree) - len(kept)
        if len(kept) == len(tree):
            return tree, masks, None
        refused_token = tree.tokens[refused - 1] if tree.is_chain else None
        renumber = {0: 0, **{old: new for new, old in enumerate(kept, start=1)}}
        pruned = DraftTree(
            [tree.tokens[i - 1] for i in kept],
            [renumber[tree.parents[i - 1]] for i in kept],
            None if tree.scores is None else [tree.scores[i - 1] for i in kept],
        )
        return pruned, masks, refused_token

    def masked(self, processed: mx.array, masks: np.ndarray | None) -> mx.array:
        """Processed verify rows with what the grammar forbids at each set to -inf: the
        distribution constrained plain decoding draws from, renormalised by the softmax."""
        return processed if masks is None else masked_logits(processed, masks)

    def accept(
        self,
        tree: DraftTree,
        processed: mx.array,
        draft: Draft | None,
        choices: list[int] | None = None,
        ties: list[bool] | None = None,
        refused: int | None = None,
    ) -> tuple[list[int], int]:
        """(accepted nodes, the target's own next token) from the verify's processed
        logits: the greedy walk (over `choices`, the argmax rows, when already known),
        rejection sampling against a drafter's q, or multi-candidate rejection for
        drafts without q. `ties`: which rows are near ties, when already known.
        `refused`: the draft token after the line that the grammar refused (`constrain`):
        drawn from q, it is rejected here (its p is 0) and the target's token comes from
        the residual max(0, p - q), as if the pass had verified it."""
        if self.sampling.greedy:
            path, own_token = greedy_walk(tree, choices or self.scorer.greedy_tokens(processed))
            if self.counts_near_ties:
                kept = [0, *path]
                if ties is None:
                    self.record.near_ties += self.scorer.near_ties(processed, kept)
                else:
                    self.record.near_ties += sum(ties[row] for row in kept)
            return path, own_token
        target_probs = np.asarray(self.scorer.probabilities(processed))
        if draft is not None and draft.probs is not None:  # a drafter's own q
            draft_probs = match_width(draft.probs, target_probs.shape[-1])
            line = [*tree.tokens, *([] if refused is None else [refused])]
            n, own_token = rejection_sample(line, draft_probs, target_probs, self.rng)
            return list(range(1, n + 1)), own_token
        return sample_walk(tree, target_probs, self.rng)

    def pending_logprobs(
        self, tree: DraftTree, processed: mx.array, path: list[int], own_token: int
    ) -> PendingLogprobs | None:
        """The round's new tokens' logprobs (lazy), where the request asked for them: node
        `path[j]` was predicted by its parent's row (`path[j - 1]`, the pending token's row
        0 for the first), the target's own token by the last kept node's row."""
        if self.top_logprobs is None:
            return None
        new_tokens = [*tree.path_tokens(path[-1] if path else 0), own_token]
        return pending_logprobs(processed, [0, *path], new_tokens, self.top_logprobs)

    def advance(
        self,
        tree: DraftTree,
        path: list[int],
        own_token: int,
        situation: Situation | None,
        draft_seconds: float,
        round_start: float,
        price: Callable[[float], float] | None = None,
        logprobs: list[TokenLogprob] | None = None,
        forced: int = 0,
    ) -> Iterator[Event]:
        """Take in one verified round: count it, extend the sequence, yield its events.

        `price(round_seconds)` is what the round cost in plain target steps
        (mlxspec/speedup.py); the run record's speedup estimate adds it up. A batched
        round shares its pass with other requests and has no such price (None).
        `logprobs`: one per new token (`pending_logprobs`, read), where asked for.
        `forced`: the line's first tokens that the grammar forced (drafted for free):
        counted apart; the proposer's drafts after them count as its own, and teach its
        policy only where the target kept every forced one (else they were never tried)."""
        n_accepted, record = len(path), self.record
        record.drafter_seconds += draft_seconds
        own_drafts = 0
        if tree.tokens:
            record.grammar_drafted += forced
            record.grammar_accepted += min(forced, n_accepted)
            own_drafts, own_accepted = max(tree.depths) - forced, max(0, n_accepted - forced)
            if own_drafts:
                record.count_round(own_drafts, own_accepted)
            if own_drafts and n_accepted >= forced:
                self.policy.update(situation, own_drafts, own_accepted, draft_seconds)
        new_tokens = [*tree.path_tokens(path[-1] if path else 0), own_token]
        kinds = ["accepted"] * n_accepted + [
            "bonus" if not tree.children()[path[-1] if path else 0] else "corrected"
        ]
        produced_before = len(self.produced)
        for j, (token, kind) in enumerate(zip(new_tokens, kinds)):
            if token in self.eos:
                self.finished = "stop"
                break
            if self.constraint is not None:
                self.constraint.take([token])
            self.produced.append(token)
            if logprobs is not None:
                self.produced_logprobs.append(logprobs[j])
            self.text.add(kind, token)
            if len(self.produced) >= self.max_tokens:
                self.finished = "length"
                break
            if self.constraint is not None and self.constraint.stopped:
                # Complete: the grammar allows only the end now, which plain decoding
                # would spend a pass to choose.
                self.finished = "stop"
                break
        self.sequence.extend(new_tokens)
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
            record.time_to_first_token = self.first_token_at - self.start
            record.first_round_tokens = len(self.produced)

        rejected = tuple(refused_line(tree, path))
        if rejected:
            yield Rejected(rejected, self.tokenizer.decode(list(rejected)))
        if self.finished is not None:
            self.text.finish()
        released_before = self.text.released
        pieces = self.text.release(final=self.finished is not None)
        emitted_before = len(self.emitted)
        self.emitted.extend(piece.token for piece in pieces if piece.token >= 0)
        placed = None
        if self.top_logprobs is not None:
            # Emitted tokens are the first of those produced: a stop string cuts the rest.
            entries = self.produced_logprobs[emitted_before : len(self.emitted)]
            placed = _placed(pieces, entries, released_before)
            self.emitted_logprobs.extend(placed)
        yield from _events(pieces, placed)
        if self.text.stopped:
            self.finished = "stop"
        elif self.finished is None and self._out_of_time():
            self.finished, self.record.limit = "stop", "time"
        round_seconds = time.perf_counter() - round_start + draft_seconds
        plain_steps = 1.0
        if price is not None:
            plain_steps = price(round_seconds)
            record.speedup_estimate.add_round(len(self.produced) - produced_before, plain_steps)
        source = "none"
        if tree.tokens:
            source = situation.source.name if own_drafts else "grammar"
        yield Step(
            source,
            len(tree.tokens),
            n_accepted,
            round_seconds,
            plain_steps,
        )

    def _out_of_time(self) -> bool:
        """A line is written and decoding has taken longer than `line_seconds`."""
        if self.line_seconds is None or self.first_token_at is None:
            return False
        late = time.perf_counter() - self.first_token_at > self.line_seconds
        return late and "\n" in self.text.text[: self.text.released]

    def done(self) -> Done:
        if hasattr(self.proposer, "annotate"):  # e.g. drafts from history vs the request
            self.proposer.annotate(self.record)
        self.record.finish_reason = self.finished
        if self.shared_pass:  # a batch's rows: mlx-lm's batch cache has no quantized form
            self.record.kv = FLOAT.key
        self.record.stop_string = self.text.matched
        self.record.limit = self.text.limit or self.record.limit
        self.record.completion_tokens = len(self.emitted)
        self.record.decode_seconds = time.perf_counter() - self.first_token_at
        logprobs = None if self.top_logprobs is None else tuple(self.emitted_logprobs)
        return Done(self.record, self.text.text, tuple(self.emitted), logprobs)


def refused_line(tree: DraftTree, path: list[int]) -> list[int]:
    """The drafts the target refused, for display: below the last accepted node, the
    line the drafter rated best (its best-scored child at every step; without scores, the
    first)."""
    kids, node, line = tree.children(), path[-1] if path else 0, []
    while kids[node]:
        node = max(kids[node], key=lambda c: tree.scores[c - 1] if tree.scores else -c)
        line.append(tree.tokens[node - 1])
    return line


def match_width(probs: mx.array | None, width: int) -> np.ndarray | None:
    """Draft and target LM heads may be padded to different widths (e.g. Gemma 3 1B vs
    12B); the extra ids are never real tokens, so zero-pad or cut the draft rows."""
    if probs is None:
        return None
    rows = np.asarray(probs)
    if rows.shape[-1] < width:
        return np.pad(rows, ((0, 0), (0, width - rows.shape[-1])))
    return rows[:, :width]


def _placed(pieces, entries: list[TokenLogprob], offset: int) -> list[TokenLogprob]:
    """`entries` (one per released token, in order) with where each token's text starts
    in the output; `offset`: where the first piece starts."""
    placed, upcoming = [], iter(entries)
    for piece in pieces:
        if piece.token >= 0:
            placed.append(dataclasses.replace(next(upcoming), offset=offset))
        offset += len(piece.text)
    return placed


def _events(pieces, logprobs: list[TokenLogprob] | None = None) -> Iterator[Event]:
    """Group consecutive pieces of one kind into one event (with its tokens' share of
    `logprobs`, one per released token, where asked for)."""
    upcoming = iter(logprobs or ())
    group: list = []
    for piece in pieces:
        if group and group[-1].kind != piece.kind:
            yield _event(group, upcoming, logprobs is not None)
            group = []
        group.append(piece)
    if group:
        yield _event(group, upcoming, logprobs is not None)


def _event(group, logprobs: Iterator[TokenLogprob], with_logprobs: bool) -> Event:
    tokens = tuple(p.token for p in group if p.token >= 0)
    entries = tuple(next(logprobs) for _ in tokens) if with_logprobs else None
    return EVENT_FOR_KIND[group[0].kind](tokens, "".join(p.text for p in group), entries)
