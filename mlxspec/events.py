"""The event stream every front end consumes, and the run record it ends with.

One generator (`Engine.stream`) yields these; the TUI, the API server, `generate` and
`bench` only render them. Text pieces are exact slices of the final output, so
concatenating the `text` of Accepted/Corrected/Bonus events gives the answer.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from mlxspec.logprobs import TokenLogprob
from mlxspec.speedup import SpeedupEstimate


@dataclass(frozen=True)
class TokenEvent:
    tokens: tuple[int, ...]
    text: str
    # One per token, where the request asked for logprobs (None: it did not).
    logprobs: tuple[TokenLogprob, ...] | None = None


class Accepted(TokenEvent):
    """Draft tokens the target agreed with (they are part of the output)."""


class Corrected(TokenEvent):
    """The target's own token where it refused a draft."""


class Bonus(TokenEvent):
    """The target's own token after a fully accepted draft, or with no draft at all."""


class Rejected(TokenEvent):
    """Drafts the target refused: never part of the output, shown as ghost text."""


@dataclass(frozen=True)
class Step:
    """One propose/verify round."""

    proposer: str
    drafted: int
    accepted: int
    seconds: float
    plain_steps: float = 1.0  # what the round cost in plain target steps (see speedup.py)


OUTPUT_EVENTS = (Accepted, Corrected, Bonus)


class ProgressNote(str):
    """A `notify` message about long work that reports how far it is (`done` of `total`).

    A str, so any front end can show it as a line; a terminal can overwrite the previous
    note in place instead of scrolling one line per step.
    """

    done: int
    total: int

    def __new__(cls, text: str, done: int, total: int) -> ProgressNote:
        note = super().__new__(cls, text)
        note.done, note.total = done, total
        return note


@dataclass
class RunRecord:
    """What one generation did: the governance record behind `--json` and `x_mlxspec`.

    `lossless` (computed, see the property) says whether the output is guaranteed to be
    what the target alone would produce.
    """

    model: str
    proposer: str
    speculative: bool
    # SamplingSettings.to_dict(), with the seed used: temperature, top-p, top-k, and the
    # repetition, presence and frequency penalties with their windows.
    sampling: dict[str, Any]
    prompt_tokens: int = 0
    # The most tokens this request could make: what it asked for (or the model's default),
    # within the server's limit and the context's room. A client that asked for more (an
    # Anthropic client must ask, and asks large) reads here what it was granted.
    max_tokens: int = 0
    completion_tokens: int = 0
    # Of the completion tokens, those of the model's reasoning, its thinking markers
    # included (set where the answer is read into parts: output_parser.AnswerReader).
    reasoning_tokens: int = 0
    # Whether the prompt left the model its thinking: "on", "off" (the template closed it,
    # e.g. enable_thinking=false: what block drafters trained on plain answers expect),
    # "" (no thinking markup, or a raw completion). Set where reasoning_tokens is.
    thinking: str = ""
    reused_prompt_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0
    # Per draft position j (0 = first): rounds that drafted it, rounds that kept it.
    # For a draft tree a position is a depth, and `drafted` counts the tree's depth.
    drafted_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    # Rounds by accepted drafts: accepted_lengths[n] rounds kept n drafts (speculative
    # rounds only): the acceptance-length distribution, chain or tree.
    accepted_lengths: list[int] = field(default_factory=list)
    # Draft trees (--tree): whether asked for, rounds verified as a tree, nodes verified
    # in them (the pending token excluded), and why not where the model cannot.
    tree: bool = False
    tree_rounds: int = 0
    tree_nodes: int = 0
    tree_unavailable: str = ""
    # Suffix decoding: draft tokens from this request's own text and from the model's
    # history of earlier requests; the history's size in tokens (0: not read).
    drafted_from_request: int = 0
    drafted_from_history: int = 0
    history_tokens: int = 0
    # Structured output: the grammar's kind ("": none; with one, `lossless` is measured
    # against constrained plain decoding), the drafts its forced tokens made, how many of
    # those the target kept, and proposers' draft tokens it refused before the pass.
    grammar: str = ""
    grammar_drafted: int = 0
    grammar_accepted: int = 0
    grammar_pruned: int = 0
    # Batched serving: batch_sizes[b] = rounds this request ran in a target pass of b rows.
    batch_sizes: list[int] = field(default_factory=list)
    time_to_first_token: float = 0.0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0  # after the first round (which prefill and TTFT cover)
    # The proposer's own time, every round (a draft model's catch-up passes and steps, a
    # lookup's search): what drafting cost beside the verify passes. 0 while it was off.
    drafter_seconds: float = 0.0
    first_round_tokens: int = 0
    # Tokens made over plain steps spent, each round priced with its own times (batched
    # rounds are not priced: to_dict gives null then).
    speedup_estimate: SpeedupEstimate = field(default_factory=SpeedupEstimate)
    k_policy: str = "adaptive"
    cache_strategy: str = "trim"
    # The form the target's KV cache was held in (`KVForm.key`: "kv float", or e.g.
    # "kv q8 g64 from 0"); greedy output equals plain greedy's with the same form.
    kv: str = "kv float"
    finish_reason: str = "length"
    stop_string: str | None = None  # the stop string that ended the output, if one did
    # An inline completion's own end, where one cut it: "indent" (a less indented line),
    # "time" (a line written after the decoding time allowed); see GenerationSettings.
    limit: str | None = None
    # Greedy speculative choices whose best two logits were within NEAR_TIE (see
    # `lossless`): where rounding alone could have picked another token than plain decoding.
    near_ties: int = 0
    device: dict[str, Any] = field(default_factory=dict)
    # The target's weights: the form chosen (--weights), why, and what they are in memory.
    weights: dict[str, str] = field(default_factory=dict)
    # Distributed runs (--ranks/--hostfile): the target sharded over `ranks` processes.
    ranks: int = 1
    backend: str = "none"  # ring, jaccl, mpi
    parallel: str = "none"  # tensor or pipeline
    collective_seconds: float = 0.0  # waiting in mlxspec's own per-round collectives
    collective_rounds: int = 0
    allreduce_seconds: float = 0.0  # one hidden-state all-reduce, measured at start
    allreduces_per_forward: int = 0  # inside the sharded model's forward pass
    load_peak_kb: list[int] = field(default_factory=list)  # MLX's peak loading, per rank

    @property
    def lossless(self) -> bool:
        """True when the output is guaranteed to be what the target alone would produce.

        Greedy: the same tokens as plain decoding, unless a speculative round chose a
        token whose margin over the runner-up was below NEAR_TIE (`near_ties` > 0): a
        batched verify rounds differently from one-token steps, so there plain decoding
        may have picked the other token. Plain rounds (no proposer) of a request decoding
        alone are plain decoding; in a batch (serve --max-batch) they are counted too.
        Sampling: the same distribution by exact rejection sampling, so always True;
        its arithmetic is float32 like plain sampling's. Every acceptance path in the
        engine is exact, so near ties are the only thing that makes this False.
        With a grammar (`grammar`), "plain decoding" is constrained plain decoding: every
        step masked to the tokens the grammar allows.
        """
        return self.near_ties == 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Accepted drafts per verify step (add 1 for the target's own token)."""
        return self.accepted / self.verify_steps if self.verify_steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        """Decode rate: tokens after the first round, over the time after it.

        The first round runs right after the prefill and is counted in time to first
        token; excluding it whole keeps its accepted drafts from counting as free.
        """
        decoded = self.completion_tokens - self.first_round_tokens
        if self.decode_seconds <= 0 or decoded < 1:
            return 0.0
        return decoded / self.decode_seconds

    def count_round(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.verify_steps += 1
        self.accepted_lengths.extend([0] * (accepted + 1 - len(self.accepted_lengths)))
        self.accepted_lengths[accepted] += 1
        for counts, n in (
            (self.drafted_by_position, drafted),
            (self.accepted_by_position, accepted),
        ):
            counts.extend([0] * (drafted - len(counts)))
            for j in range(n):
                counts[j] += 1

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["lossless"] = self.lossless
        data["acceptance_rate"] = round(self.acceptance_rate, 4)
        data["mean_accepted_length"] = round(self.mean_accepted_length, 4)
        data["acceptance_by_position"] = [  # P(kept | drafted) at each position
            round(a / d, 4) for a, d in zip(self.accepted_by_position, self.drafted_by_position)
        ]
        data["tokens_per_second"] = round(self.tokens_per_second, 3)
        estimate = self.speedup_estimate  # none for batched rounds: they share a pass
        data["estimated_speedup"] = round(estimate.value, 3) if estimate.steps else None
        data["mean_tree_nodes"] = round(
            self.tree_nodes / self.tree_rounds if self.tree_rounds else 0.0, 3
        )
        data["collective_seconds_per_round"] = round(
            self.collective_seconds / self.collective_rounds if self.collective_rounds else 0.0, 6
        )
        return data


@dataclass(frozen=True)
class Done:
    record: RunRecord
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token id, where asked for


Event = Accepted | Corrected | Bonus | Rejected | Step | Done
