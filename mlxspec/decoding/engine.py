"""The engine: a loaded target, its proposers and what they learned; one generator of
events (`stream`) for every front end.

Per round: the proposer drafts up to k tokens (k from the policy), the target runs
ONCE over [pending token] + drafts, the longest acceptable prefix is kept (greedy:
drafts equal to the target's argmax; sampling: rejection sampling), plus one token of
the target's own; the target's KV cache is rolled back past the rest.

There is one round loop, the batch scheduler's (batch/scheduler.py). `stream` is its
batch of one: the engine's own `Target` behind the batch's cache calls
(batch/single.py), which adds what only a single sequence does yet (draft trees,
hidden states for heads, self-speculation, rotating windows, the prompt cache kept
across requests), with the engine's own proposer and kept policy. This module holds
what both the batch and the single request ask of the engine: checking a request,
starting its run (`new_run`), its policy, pricing a round, drafting a tree, and
ending it (`finish`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from mlxspec import device
from mlxspec.batch.memory import Holdings, prompt_cache_bytes
from mlxspec.batch.memory import check_request as check_memory
from mlxspec.batch.scheduler import Scheduler
from mlxspec.batch.single import SingleCaches
from mlxspec.decoding.policy import Policy
from mlxspec.decoding.request import RequestRun
from mlxspec.decoding.verify_cost import (
    CALIBRATION_BUDGET_S,
    LONG_CONTEXT,
    LONG_PRICED_FROM,
    VerifyCost,
    cached_verify_cost,
    calibration_key,
    fills_synthetically,
    measure_verify_cost,
)
from mlxspec.decoding.weights_choice import WeightsChoice, weights_record
from mlxspec.events import Done, Event, ProgressNote, RunRecord
from mlxspec.markup.chat_template import encode_chat
from mlxspec.markup.conversation import Conversation
from mlxspec.markup.fim import FimLayout, Infill, InfillBudget, encode_infill, find_layout
from mlxspec.models.kv_form import FLOAT, KVForm
from mlxspec.models.prompt_cache import PromptCache
from mlxspec.models.target import Target
from mlxspec.models.tree import DraftTree, best_size, chain, keep_best
from mlxspec.proposers.base import ProposalContext, Proposer
from mlxspec.settings import GenerationError, GenerationSettings, NoFimTokens, PromptTooLong
from mlxspec.structured.grammar import COMPILE_SECONDS, QUICK_SECONDS, Constraint, Grammar
from mlxspec.suffix.store import HistoryStore


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
        weights: WeightsChoice | None = None,
        prompt_cache: PromptCache | None = None,
        fim: tuple[str, str] = ("auto", "auto"),
        kv: KVForm = FLOAT,
    ):
        """`prompt_cache`: where earlier prompts' caches are kept, for this engine's
        requests alone and its batch's rows alike (default: one bounded by a share of
        the device's memory, `batch.memory.prompt_cache_bytes`); `fim`: models.toml's `fim`
        and `fim_order`, how the fill-in-the-middle layout is found (markup/fim.py). `kv`:
        the form the target's KV cache is held in (`--kv-bits`; a batch of several rows
        keeps float)."""
        self.name, self.tokenizer = name, tokenizer
        if prompt_cache is None:
            prompt_cache = PromptCache(max_bytes=prompt_cache_bytes(None))
        self.prompt_cache = prompt_cache
        self.kv = kv
        # What the model holds (set by the runtime that opened it): each request's prompt
        # and max_tokens are checked against it before any prefill. None: not checked.
        self.holdings: Holdings | None = None
        self.target = Target(model, prompt_cache, kv)
        # The form the target's weights were loaded in, and what they are in memory:
        # for the run record, and the calibration key (a curve prices one form only).
        self.weights = weights_record(model, weights)
        self.proposers = {p.name: p for p in proposers}
        self._verify_cost = verify_cost
        self._long_verify_cost: VerifyCost | None = None  # measured when a request needs it
        # Costs handed in (tests, a sharded rank's own calibration) fix the machine model:
        # then nothing else is measured either (e.g. the batch's pass grid).
        self.measures_costs = verify_cost is None
        self.notify = notify  # one-line progress messages for long, rare work
        self.history = history  # fed every finished request (prompt + output)
        self._policies: dict[tuple[str, int | None], Policy] = {}
        self.vocab_size = len(tokenizer.get_vocab())
        self.fim: FimLayout | None = find_layout(tokenizer, *fim)
        # A FIM model's pad and file separators end a completion wherever it writes one,
        # as in llama.cpp: past them it would fill another hole or start another file.
        for token_id in self.fim.end_ids if self.fim else ():
            tokenizer.add_eos_token(str(token_id))

    @property
    def verify_cost(self) -> VerifyCost:
        """Measured once per model and machine (at most CALIBRATION_BUDGET_S), then read
        from the cache."""
        if self._verify_cost is None:
            key = calibration_key(self.name, self.weights["held"], kv=self.kv)

            def measure() -> VerifyCost:
                cost = measure_verify_cost(
                    self.target.model, self.vocab_size, progress=self._progress(""), kv=self.kv
                )
                if cost.partial:
                    self.notify(
                        f"verify cost measured up to {max(cost.points)} tokens in "
                        f"{CALIBRATION_BUDGET_S:g} s (wide passes are slow here); wider "
                        "drafts are priced as dear as proportional, corrected as decoding runs"
                    )
                return cost

            self._verify_cost = cached_verify_cost(key, measure)
        return self._verify_cost

    @property
    def long_verify_cost(self) -> VerifyCost | None:
        """The curve behind LONG_CONTEXT tokens, measured the first time a long prompt
        asks (`new_run`), on synthetic KV, within CALIBRATION_BUDGET_S of its own, then read
        from the cache under its own key. None where costs were handed in (tests, a
        sharded rank: its ranks would have to measure together) or the model's cache is
        not plain attention KV (a sliding window, recurrent layers)."""
        if self._long_verify_cost is None and self.measures_costs:
            if not fills_synthetically(self.target.model):
                return None
            key = calibration_key(self.name, self.weights["held"], kv=self.kv, context=LONG_CONTEXT)
            self._long_verify_cost = cached_verify_cost(
                key,
                lambda: measure_verify_cost(
                    self.target.model,
                    self.vocab_size,
                    context=LONG_CONTEXT,
                    progress=self._progress(f" behind {LONG_CONTEXT} tokens of context"),
                    kv=self.kv,
                    synthetic=True,
                ),
            )
        return self._long_verify_cost

    def _progress(self, where: str) -> Callable[[int, int, int], None]:
        """A calibration's progress, as one-line notes."""

        def progress(done: int, total: int, size: int) -> None:
            self.notify(
                ProgressNote(
                    f"measuring verify cost{where} on this machine (once per model, at most "
                    f"{CALIBRATION_BUDGET_S:g} s): {size}-token pass, {done}/{total}",
                    done,
                    total,
                )
            )

        return progress

    def reset(self) -> None:
        """Forget cached prompts and what the policies learned (e.g. for a cold benchmark
        run); the machine's verify-cost calibration is kept."""
        self.target.reset()
        self.prompt_cache.clear()
        for proposer in self.proposers.values():
            getattr(proposer, "reset", lambda: None)()
        self._policies.clear()

    def save_prompts(self) -> None:
        """Every kept prompt cache (the target's own too) to the pool's disk, if it has
        one: called as the process ends, so that the next one starts warm."""
        if self.prompt_cache.disk is not None:
            self.target.put_away()
            self.prompt_cache.flush()

    def add_proposer(self, proposer: Proposer) -> None:
        self.proposers[proposer.name] = proposer

    def kept_policy(self, proposer: Proposer | None, fixed_k: int | None) -> Policy:
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

    def encode_chat(self, conversation: Conversation | list[dict]) -> list[int]:
        """Token ids for a conversation (or bare messages), through the model's own chat
        template, ready for the assistant's answer."""
        messages = conversation.messages if isinstance(conversation, Conversation) else conversation
        if not messages:
            raise GenerationError("messages must not be empty")
        return encode_chat(self.tokenizer, conversation, generation_prompt=True)

    def encode_infill(self, infill: Infill, settings: GenerationSettings) -> list[int]:
        """A fill-in-the-middle request's token ids in the model's own FIM layout, each part
        within its share of the context; GenerationError for a model with no FIM tokens."""
        if self.fim is None:
            raise NoFimTokens(self.name)
        budget = InfillBudget(settings.context, settings.max_tokens)
        return encode_infill(self.tokenizer, self.fim, infill, budget)

    def stream(
        self,
        prompt: str | list[int] | list[dict] | Conversation,
        settings: GenerationSettings | None = None,
        proposer: str | None = None,
    ) -> Iterator[Event]:
        """Generate from a raw string, token ids, chat messages or a conversation (with
        tools); yield events.

        A batch of one through the scheduler's round. Events come a round at a time,
        after the round's cache work: closing the generator between them leaves the
        target's cache holding the request's tokens so far, which the next request
        reuses like any earlier one (the chat's Escape, a client that left)."""
        settings = settings or GenerationSettings()
        solo = Scheduler(self, max_batch=1, caches=SingleCaches(self.target, self.notify))
        request_id = solo.submit(prompt, settings, proposer)
        try:
            while solo.busy:
                events = solo.step().get(request_id, [])
                if request_id in solo.failed:  # its proposer or its text failed: as raised
                    raise solo.failed[request_id]
                yield from events
        finally:
            solo.close()  # closed early: a pass launched for the next round is taken back

    def check_request(
        self,
        prompt: str | list[int] | list[dict] | Conversation | Infill,
        settings: GenerationSettings,
        proposer: str | None,
    ) -> tuple[list[int], int]:
        """(prompt token ids, most tokens to generate), or GenerationError naming what is
        wrong with the request."""
        if isinstance(prompt, str):
            prompt_tokens = self.tokenizer.encode(prompt)
        elif isinstance(prompt, Infill):
            prompt_tokens = self.encode_infill(prompt, settings)
        elif isinstance(prompt, Conversation) or (prompt and isinstance(prompt[0], dict)):
            prompt_tokens = self.encode_chat(prompt)
        else:
            prompt_tokens = list(prompt)
        if not prompt_tokens:
            raise GenerationError("the prompt is empty")
        if min(prompt_tokens) < 0 or max(prompt_tokens) >= self.vocab_size:
            raise GenerationError(f"token ids must be in 0..{self.vocab_size - 1}")
        room = settings.context - len(prompt_tokens)
        if room < 1:
            raise PromptTooLong(len(prompt_tokens), settings.context)
        if proposer not in (None, "none") and proposer not in self.proposers:
            raise GenerationError(
                f"unknown proposer '{proposer}'; available: none, {', '.join(self.proposers)}"
            )
        max_tokens = min(settings.max_tokens, room)
        if self.holdings is not None:
            check_memory(self.holdings, len(prompt_tokens), max_tokens)
        return prompt_tokens, max_tokens

    def constraint(
        self, grammar: Grammar | None, wait: float = COMPILE_SECONDS
    ) -> Constraint | None:
        """A request's grammar at its start (None: no grammar), compiling on a thread of
        its own; `wait`: how long to wait for it here, where a grammar that cannot be
        enforced raises GrammarError (a GenerationError). Compiled grammars are cached."""
        return (
            None if grammar is None else Constraint(grammar, self.tokenizer, self.vocab_size, wait)
        )

    def new_run(
        self,
        prompt_tokens: list[int],
        settings: GenerationSettings,
        proposer: Proposer | None,
        max_tokens: int,
        policy: Policy,
    ) -> RequestRun:
        """A request's decoding state, its run record started. From a prompt of
        LONG_PRICED_FROM tokens on, its policy prices rounds by context length: the
        long-context curve is measured now, before the prefill, if it never was (the
        prompt, not what the answer may add: a budget of max_tokens is no context yet, and
        a chat's next turn carries the answer in its prompt)."""
        long = len(prompt_tokens) >= LONG_PRICED_FROM
        if long and proposer is not None and policy.fixed_k is None and policy.long_cost is None:
            policy.long_cost = self.long_verify_cost
        record = RunRecord(
            model=self.name,
            proposer=proposer.name if proposer else "none",
            speculative=proposer is not None,
            sampling={},
            prompt_tokens=len(prompt_tokens),
            max_tokens=max_tokens,
            k_policy=policy.label if proposer else "off",
            cache_strategy=self.target.strategy,
            kv=self.kv.key,
            device=device.describe(),
            weights=self.weights,
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
            top_logprobs=settings.logprobs,
            constraint=self.constraint(settings.grammar, QUICK_SECONDS),
            min_indent=settings.min_indent,
            line_seconds=settings.line_seconds,
        )

    def finish(self, run: RequestRun) -> Done:
        """End a request: its Done event, and its prompt and output fed to the model's
        history (suffix decoding) unless history is off for it."""
        done = run.done()
        if run.history and self.history is not None:
            self.history.add(run.transcript)
        return done

    def round_cost(self, policy: Policy, m: int) -> float:
        """c(m): a verify of m tokens relative to a one-token step, as the adaptive policy
        corrects it online (a fixed k has no curve of its own: the calibrated one)."""
        if m == 1:
            return 1.0
        return policy.verify_cost(m) if policy.fixed_k is None else self.verify_cost(m)

    def draft_tree(
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
