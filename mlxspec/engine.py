"""The speculative decoding loop: one generator of events for every front end.

Per round: the proposer drafts up to k tokens (k from the policy), the target runs
ONCE over [pending token] + drafts, the longest acceptable prefix is kept (greedy:
drafts equal to the target's argmax; sampling: rejection sampling), plus one token of
the target's own; the target's KV cache is rolled back past the rest.

This module drafts, verifies and rolls back one sequence at a time; what a round keeps
and the events it yields are `RequestRun`'s (request.py), which the batched scheduler
(batch/scheduler.py) shares, and `Engine.finish` ends a request for both loops.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial

import mlx.core as mx

from mlxspec import device
from mlxspec.chat_template import encode_chat
from mlxspec.events import Done, Event, ProgressNote, RunRecord
from mlxspec.policy import (
    Policy,
    VerifyCost,
    cached_verify_cost,
    calibration_key,
    measure_verify_cost,
)
from mlxspec.proposers.base import ProposalContext, Proposer, hidden_capture
from mlxspec.request import RequestRun
from mlxspec.sampling import SamplingSettings
from mlxspec.speedup import round_steps
from mlxspec.suffix.store import HistoryStore
from mlxspec.target import Target
from mlxspec.tree import DraftTree, best_size, chain, keep_best


class GenerationError(ValueError):
    """A request the engine cannot serve (empty prompt, too long for the context...)."""


@dataclass
class GenerationSettings:
    max_tokens: int = 256
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    stop: Sequence[str] = ()
    k: int | None = None  # None: adaptive; an int: fixed draft length (0 = plain)
    context: int = 8192  # prompt + completion tokens the model may see
    tree: bool = False  # verify a tree of candidates per round instead of one line
    tree_nodes: int = 32  # most draft nodes a tree may have (its verify cost prunes it)
    history: bool = True  # read and feed the model's history of earlier requests

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise GenerationError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.k is not None and self.k < 0:
            raise GenerationError(f"k must be >= 0, got {self.k}")
        if self.tree_nodes < 1:
            raise GenerationError(f"tree_nodes must be >= 1, got {self.tree_nodes}")


class Engine:
    """A loaded target plus its proposers; keeps the KV cache between requests."""

    def __init__(
        self,
        model,
        tokenizer,
        name: str = "model",
        proposers: Sequence[Proposer] = (),
        verify_cost: VerifyCost | None = None,
        notify: Callable[[str], None] = lambda _: None,
        history: HistoryStore | None = None,
    ):
        self.name, self.tokenizer = name, tokenizer
        self.target = Target(model)
        self.proposers = {p.name: p for p in proposers}
        self._verify_cost = verify_cost
        # Costs handed in (tests, a sharded rank's own calibration) fix the machine model:
        # then nothing else is measured either (e.g. the batch's pass grid).
        self.measures_costs = verify_cost is None
        self.notify = notify  # one-line progress messages for long, rare work
        self.history = history  # fed every finished request (prompt + output)
        self._policies: dict[tuple[str, int | None], Policy] = {}
        self.vocab_size = len(tokenizer.get_vocab())

    @property
    def verify_cost(self) -> VerifyCost:
        """Measured once per model and machine (a few seconds), then read from the cache."""
        if self._verify_cost is None:
            key = calibration_key(self.name)

            def progress(done: int, total: int, size: int) -> None:
                self.notify(
                    ProgressNote(
                        "measuring verify cost on this machine (once per model): "
                        f"{size}-token pass, {done}/{total}",
                        done,
                        total,
                    )
                )

            def measure() -> VerifyCost:
                return measure_verify_cost(self.target.model, self.vocab_size, progress=progress)

            self._verify_cost = cached_verify_cost(key, measure)
        return self._verify_cost

    def reset(self) -> None:
        """Forget cached prompts and what the policies learned (e.g. for a cold benchmark
        run); the machine's verify-cost calibration is kept."""
        self.target.reset()
        for proposer in self.proposers.values():
            getattr(proposer, "reset", lambda: None)()
        self._policies.clear()

    def add_proposer(self, proposer: Proposer) -> None:
        self.proposers[proposer.name] = proposer

    def _policy(self, proposer: Proposer | None, fixed_k: int | None) -> Policy:
        """One policy per proposer and k setting, kept across requests: what it learned
        about acceptance and costs in this conversation carries over to the next turn."""
        key = (proposer.name if proposer else "none", 0 if proposer is None else fixed_k)
        if key not in self._policies:
            self._policies[key] = self.new_policy(proposer, fixed_k)
        return self._policies[key]

    def new_policy(self, proposer: Proposer | None, fixed_k: int | None) -> Policy:
        """A policy that has learned nothing yet (no proposer: k = 0)."""
        if proposer is None:
            fixed_k = 0
        cost = self.verify_cost if fixed_k is None else VerifyCost({1: 1.0, 2: 1.0}, 1.0)
        return Policy(cost, fixed_k=fixed_k)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Token ids for a conversation, through the model's own chat template."""
        if not messages:
            raise GenerationError("messages must not be empty")
        return encode_chat(self.tokenizer, messages, generation_prompt=True)

    def stream(
        self,
        prompt: str | list[int] | list[dict],
        settings: GenerationSettings | None = None,
        proposer: str | None = None,
    ) -> Iterator[Event]:
        """Generate from a raw string, token ids or chat messages; yield events."""
        settings = settings or GenerationSettings()
        prompt_tokens, max_tokens = self.check_request(prompt, settings, proposer)
        active = self.proposers.get(proposer) if proposer else None
        yield from self._run(prompt_tokens, settings, active, max_tokens)

    def check_request(
        self,
        prompt: str | list[int] | list[dict],
        settings: GenerationSettings,
        proposer: str | None,
    ) -> tuple[list[int], int]:
        """(prompt token ids, most tokens to generate), or GenerationError naming what is
        wrong with the request."""
        if isinstance(prompt, str):
            prompt_tokens = self.tokenizer.encode(prompt)
        elif prompt and isinstance(prompt[0], dict):
            prompt_tokens = self.encode_chat(prompt)
        else:
            prompt_tokens = list(prompt)
        if not prompt_tokens:
            raise GenerationError("the prompt is empty")
        if min(prompt_tokens) < 0 or max(prompt_tokens) >= self.vocab_size:
            raise GenerationError(f"token ids must be in 0..{self.vocab_size - 1}")
        room = settings.context - len(prompt_tokens)
        if room < 1:
            raise GenerationError(
                f"the prompt has {len(prompt_tokens)} tokens; the context allows {settings.context}"
            )
        if proposer not in (None, "none") and proposer not in self.proposers:
            raise GenerationError(
                f"unknown proposer '{proposer}'; available: none, {', '.join(self.proposers)}"
            )
        return prompt_tokens, min(settings.max_tokens, room)

    def new_run(
        self,
        prompt_tokens: list[int],
        settings: GenerationSettings,
        proposer: Proposer | None,
        max_tokens: int,
        policy: Policy,
    ) -> RequestRun:
        """A request's decoding state, its run record started."""
        record = RunRecord(
            model=self.name,
            proposer=proposer.name if proposer else "none",
            speculative=proposer is not None,
            sampling={},
            prompt_tokens=len(prompt_tokens),
            k_policy=policy.label if proposer else "off",
            cache_strategy=self.target.strategy,
            device=device.describe(),
        )
        return RequestRun(
            self.tokenizer,
            record,
            prompt_tokens,
            settings.sampling,
            settings.stop,
            max_tokens,
            policy,
            proposer,
            history=settings.history,
        )

    def finish(self, run: RequestRun) -> Done:
        """End a request: its Done event, and its prompt and output fed to the model's
        history (suffix decoding) unless history is off for it."""
        done = run.done()
        if run.history and self.history is not None:
            self.history.add(run.transcript)
        return done

    def _run(
        self,
        prompt_tokens: list[int],
        settings: GenerationSettings,
        proposer: Proposer | None,
        max_tokens: int,
    ) -> Iterator[Event]:
        policy = self._policy(proposer, settings.k)
        run = self.new_run(prompt_tokens, settings, proposer, max_tokens, policy)
        record, scorer, rng = run.record, run.scorer, run.rng
        capture = hidden_capture(proposer)
        needs_hidden = capture is not None
        can_tree = not self.target.tree_unsupported
        use_tree = settings.tree and proposer is not None and can_tree
        if settings.tree and not can_tree:
            record.tree_unavailable = self.target.tree_unsupported
        record.tree = use_tree

        record.reused_prompt_tokens, hidden = self.target.prepare(prompt_tokens, capture=capture)
        record.prefill_seconds = time.perf_counter() - run.start

        sequence = run.sequence  # ends with the pending token
        while run.finished is None:
            # 1. Draft: a line of k tokens, or a tree at most k deep.
            ctx = ProposalContext(
                sequence,
                scorer,
                rng,
                self.target,
                hidden,
                history=run.history,
                prompt_length=len(run.prompt_tokens),
            )
            situation, k = policy.choose_among(candidates(proposer, ctx), run.left)
            draft_start = time.perf_counter()
            if k and (use_tree or (can_tree and getattr(situation.source, "always_tree", False))):
                tree = self._draft_tree(situation.source, ctx, k, settings.tree_nodes, policy)
                draft = None
            else:
                draft = situation.source.propose(ctx, k) if k else None
                tree = chain(draft.tokens[:k] if draft else [])
            draft_seconds = time.perf_counter() - draft_start

            # 2. Verify every draft in one target pass.
            round_start = time.perf_counter()
            pending = sequence[-1]
            if tree.is_chain:
                logits, hidden_rows = self.target.verify([pending, *tree.tokens], capture)
            else:
                logits, hidden_rows = self.target.verify_tree(pending, tree, capture)
                record.tree_rounds += 1
                record.tree_nodes += len(tree)
            processed = scorer.process_tree(logits, sequence, tree)
            mx.eval(processed)
            verify_seconds = time.perf_counter() - round_start
            policy.observe_verify(len(tree) + 1, verify_seconds)

            # 3. Accept: a path of the tree (for a line, a prefix of it).
            choices = scorer.greedy_tokens(processed) if run.sampling.greedy else None
            if tree.tokens and hasattr(situation.source, "verified"):
                situation.source.verified(tree, choices or scorer.greedy_tokens(processed))
            path, own_token = run.accept(tree, processed, draft, choices)

            # 4. Roll back what was refused, then emit.
            if tree.is_chain:
                self.target.keep([pending, *tree.tokens], 1 + len(path))
            else:
                self.target.keep_nodes(pending, tree, path)
            if needs_hidden:  # rows of the tokens the cache just kept
                hidden = hidden_rows[mx.array([0, *path])]
            cost = self._relative_verify_cost(policy, len(tree) + 1)
            yield from run.advance(
                tree,
                path,
                own_token,
                situation,
                draft_seconds,
                round_start,
                price=partial(round_steps, verify_seconds=verify_seconds, verify_cost=cost),
            )

        if needs_hidden:  # the last round's hidden states, for the next request to build on
            proposer.observe(ProposalContext(sequence, scorer, rng, self.target, hidden))
        yield self.finish(run)

    def _relative_verify_cost(self, policy: Policy, m: int) -> float:
        """c(m): a verify of m tokens relative to a one-token step, as the adaptive policy
        corrects it online (a fixed k has no curve of its own: the calibrated one)."""
        if m == 1:
            return 1.0
        return policy.verify_cost(m) if policy.fixed_k is None else self.verify_cost(m)

    def _draft_tree(
        self, source: Proposer, ctx: ProposalContext, depth: int, budget: int, policy: Policy
    ) -> DraftTree:
        """The source's tree (a line for proposers that cannot branch), cut to the nodes
        whose expected gain pays for their share of the verify pass."""
        if hasattr(source, "propose_tree"):
            tree = source.propose_tree(ctx, depth, budget)
        else:
            tree = chain(source.propose(ctx, depth).tokens[:depth])
        if tree.scores is None:
            return tree
        # A fixed k fixes the depth; the width is still priced on this machine's curve.
        cost = policy.verify_cost if policy.fixed_k is None else self.verify_cost
        return keep_best(tree, best_size(tree, cost))


def candidates(proposer: Proposer | None, ctx: ProposalContext) -> list:
    """The situations this round could draft in: a chain offers each member's, and the
    policy picks the one with the best expected speed."""
    if proposer is None:
        return []
    if hasattr(proposer, "situations"):
        return proposer.situations(ctx)
    found = proposer.situation(ctx)
    return [found] if found is not None else []
