"""The round loop, the only one: continuous batching with speculation inside it, and a
single request as its batch of one.

Each request keeps its own state (`RequestRun`: tokens, policy, scorer and rng, text
stream, run record) and its own proposer. A round: every active request drafts (ragged
lengths, k = 0 allowed), ONE verify runs over all rows, then each request accepts
(`RequestRun.accept`/`advance`), its row is trimmed to what it kept, and its events go
to it alone.

Where the cache work goes decides what a round may do:
- `BatchCaches` (`serve --max-batch B`; on a sharded target `PlannedCaches`, which the
  other ranks replay call for call): rows of many requests share each pass, so the
  round cuts every draft to one width (`choose_width`), learns the pass's cost over
  (rows, columns), and drafts lines only; each request has a private copy of its
  proposer and a fresh policy.
- `SingleCaches` (`Engine.stream`: the chat, `generate`, the bench, a sharded rank's
  request): one row, the engine's own `Target`. The pass is the request's alone: the
  policy's own k stands, each round is priced for the run record's speedup estimate,
  and the request uses the engine's proposer and its policy kept across requests. It
  verifies draft trees, which the batch caches cannot yet.
Both hand a proposer that reads the target's hidden states (a drafter head) those of
the tokens its row's cache took in since the last round, each row its own.

Continuous: `submit` queues a request; between rounds a queued request starts its
prefill in a cache of its own, one chunk per round (so a long prompt never stalls the
others for more than a chunk; prompts joining at once share a pass where it pays,
`prefill_group`), and joins the batch when done. A finished or cancelled request leaves
at the next round boundary and frees its slot.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterator
from functools import partial

import mlx.core as mx

from mlxspec.batch.caches import BatchCaches
from mlxspec.batch.forced import draft_after, forced_tokens
from mlxspec.batch.launch import launch_next, launches_next, one_step
from mlxspec.batch.owner import RoundOwner
from mlxspec.batch.rows import (
    as_list,
    batch_greedy_reads,
    cut_tree,
    first_guess,
    greedy_reads,
    private_copy,
    read_logprobs,
    split_reads,
    unbatchable_reason,
)
from mlxspec.batch.single import SingleCaches
from mlxspec.batch.slots import Round, Slot, grammar_ready
from mlxspec.batch.target import cache_columns
from mlxspec.batch.width import ROW_FLOOR, PassCost, choose_width, pass_grid_for, prefill_group
from mlxspec.decoding.request import RequestRun
from mlxspec.events import Event
from mlxspec.logprobs import TokenLogprob
from mlxspec.markup.conversation import Conversation
from mlxspec.models.target import PREFILL_CHUNK
from mlxspec.models.tree import DraftTree, chain
from mlxspec.proposers.base import (
    ProposalContext,
    Proposer,
    Situation,
    candidates,
    hidden_capture,
)
from mlxspec.settings import GenerationError, GenerationSettings
from mlxspec.speedup import round_steps


class Scheduler:
    def __init__(
        self,
        engine: RoundOwner,
        max_batch: int = 8,
        caches: BatchCaches | SingleCaches | None = None,
        row_floor: float = ROW_FLOOR,
        kv_budget: int | None = None,
    ):
        """`caches`: where the batch's cache work goes (by default its own; a sharded
        rank 0 passes one that the other ranks replay; `Engine.stream` passes the
        engine's own target as `SingleCaches`, a batch of one). `row_floor`: the least
        share of its plain-pass speed a round's width may leave any row
        (`choose_width`). `kv_budget`: the bytes of KV the rows and kept prefixes may
        hold (`mlxspec.batch.memory`; None: no bound)."""
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if not 0.0 <= row_floor <= 1.0:
            raise ValueError(f"row_floor must be in 0..1, got {row_floor}")
        self.engine, self.max_batch, self.row_floor = engine, max_batch, row_floor
        self.prefill_chunk = PREFILL_CHUNK  # prompt tokens a joining request feeds per round
        # Finished rows' caches are kept for the next prompts, in the engine's pool.
        pool = getattr(engine, "prompt_cache", None)  # shared with its requests alone
        self.caches = caches or BatchCaches(engine.target.model, max_batch, pool)
        self.target, self.prefixes = self.caches.target, self.caches.prefixes
        # The pass is one request's alone: it keeps the engine's proposer and policy,
        # its own k stands (no width to share) and each round is priced for its record.
        self.solo = self.caches.solo
        if self.solo and max_batch != 1:
            raise ValueError("a request's own caches hold one row: max_batch must be 1")
        self.can_tree = not self.caches.tree_unsupported
        # A batch's pass cost over (rows, columns): measured, corrected by the passes run.
        self.pass_cost = (
            None if self.solo else PassCost(engine.verify_cost, grid=pass_grid_for(engine))
        )
        self.kv_budget = None if self.solo else kv_budget
        # Per attention layer (bytes a token, most columns kept), from the first joined row.
        self.kv_layout: list[tuple[float, int | None]] = []
        self.waiting: deque[Slot] = deque()
        self.joining: list[Slot] = []
        self.active: list[Slot] = []  # in the order of the target's rows
        # Requests that failed on their own (a proposer or detokenizer error): they left
        # the batch, which went on; the caller reports and removes them.
        self.failed: dict[int, Exception] = {}
        self._ids = itertools.count()

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.joining or self.active)

    def submit(
        self,
        prompt: str | list[int] | list[dict] | Conversation,
        settings: GenerationSettings | None = None,
        proposer: str | Proposer | None = None,
    ) -> int:
        """Queue a request; returns its id. In a batch, a named proposer is copied for
        this request alone and its policy starts afresh; a Proposer object is used as is
        (it must not serve another request). Alone (`solo`), the request drafts with the
        engine's own proposer and kept policy, so what they learned carries over to the
        next request (a chat's next turn)."""
        settings = settings or GenerationSettings()
        tree_reason = self.caches.tree_unsupported
        if settings.tree and tree_reason and not self.solo:
            raise GenerationError(tree_reason)
        named = proposer if isinstance(proposer, str) else None
        prompt_tokens, max_tokens = self.engine.check_request(prompt, settings, named)
        if named is not None:
            proposer = self.engine.proposers.get(named)  # None for "none"
        if self.solo:
            policy = self.engine.kept_policy(proposer, settings.k)
        else:
            cannot = self.caches.capture_unsupported  # why rows get no hidden states
            if proposer is not None and (reason := unbatchable_reason(proposer, cannot)):
                raise GenerationError(f"cannot batch this request: {reason}")
            if named is not None and proposer is not None:
                proposer = private_copy(proposer)
            policy = self.engine.new_policy(proposer, settings.k)
        run = self.engine.new_run(prompt_tokens, settings, proposer, max_tokens, policy)
        run.shared_pass = not self.solo
        trees = settings.tree and proposer is not None and not tree_reason
        run.record.tree = trees
        if settings.tree and tree_reason:
            run.record.tree_unavailable = tree_reason
        slot = Slot(next(self._ids), run, proposer, trees=trees, tree_nodes=settings.tree_nodes)
        self.waiting.append(slot)
        return slot.request_id

    def close(self) -> None:
        """Every request leaves now, with no further events (its reader stopped): a pass
        launched for a next round is taken back, so each cache holds its request's
        tokens so far (`Engine.stream` closed between rounds)."""
        for slot in [*self.waiting, *self.joining, *self.active]:
            slot.cancelled = True
        self._drop_cancelled()

    def cancel(self, request_id: int) -> None:
        """The request leaves at the next round boundary, with no further events."""
        for slot in [*self.waiting, *self.joining, *self.active]:
            if slot.request_id == request_id:
                slot.cancelled = True

    def step(self) -> dict[int, list[Event]]:
        """One round: admit and prefill (a chunk each), draft, verify all rows at once,
        accept per row; returns each request's events of this round (its last ends Done)."""
        self._drop_cancelled()
        while len(self.joining) + len(self.active) < self.max_batch:
            slot = self._next_waiting()
            if slot is None or not self._fits(slot):
                break
            self.waiting.remove(slot)
            slot.admitted_at = time.perf_counter()  # alone, `start` prefills it all
            capture = hidden_capture(slot.proposer)
            reused = self.caches.start(slot.request_id, slot.run.sequence[:-1], capture)
            slot.run.record.reused_prompt_tokens = reused
            self.joining.append(slot)
        joining, chunk = [s.request_id for s in self.joining], self.prefill_chunk
        together = prefill_group(self.caches, joining, chunk, self.pass_cost)
        fed = self.caches.advance(joining, chunk, together) if joining else []  # none: no pass
        if fed:  # in the order given: the rows join in it, in one merge
            self.caches.join(fed)
            if self.kv_budget is not None and not self.kv_layout:
                self.kv_layout = self.caches.kv_layout()
            self._make_room(self._rows_kv())  # prompts kept as they joined take room too
        for slot in [s for s in self.joining if s.request_id in fed]:
            slot.run.record.prefill_seconds = time.perf_counter() - slot.admitted_at
            self.joining.remove(slot)
            self.active.append(slot)
        if not self.active:
            return {}
        self._round()
        out = {slot.request_id: slot.events for slot in self.active if slot.events}
        for slot in self.active:
            slot.events = []
        self._leave([s for s in self.active if s.run.finished is not None or s.error])
        return out

    def _next_waiting(self) -> Slot | None:
        """The first queued request that may start: in a batch, one whose grammar still
        compiles waits while the others go ahead; alone, it prefills meanwhile."""
        ready = [slot for slot in self.waiting if self.solo or grammar_ready(slot)]
        if not ready and self.waiting and not (self.joining or self.active):
            self.waiting[0].run.constraint.wait(0.05)  # nothing else to do: no busy loop
        return ready[0] if ready else None

    @property
    def kv_per_token(self) -> float:
        """Bytes a token takes over every attention layer (0 until a row joined)."""
        return sum(per_token for per_token, _ in self.kv_layout)

    def kv_reserved(self, joining: Slot | None = None) -> float:
        """Bytes of KV its rows (`_rows_kv`, `joining` too) and kept prefixes may hold."""
        return self._rows_kv(joining) + self.prefixes.nbytes

    def _rows_kv(self, joining: Slot | None = None) -> float:
        """Rows x the longest row's context in each layer (a window layer: at most the
        columns it keeps), as the right-aligned batch cache lays them out."""
        rows = [*self.joining, *self.active, *([joining] if joining else [])]
        columns = cache_columns(max((len(s.run.sequence) + s.run.left for s in rows), default=0))
        per_row = sum(b * min(columns, cap or columns) for b, cap in self.kv_layout)
        return len(rows) * per_row

    def _fits(self, slot: Slot) -> bool:
        """Whether `slot` may join within the KV budget, kept prefixes giving way: alone
        always (its context bounds it), beside others once a row told a token's bytes."""
        if self.kv_budget is None or not (self.joining or self.active):
            return True
        if not self.kv_per_token:
            return False
        if (rows := self._rows_kv(slot)) > self.kv_budget:
            return False
        self._make_room(rows)
        return True

    def _make_room(self, rows: float) -> None:
        """Kept prefixes give way to `rows` bytes of rows: they keep what the budget leaves."""
        if self.kv_budget is not None and self.prefixes.nbytes > self.kv_budget - rows:
            self.caches.evict(max(0, int(self.kv_budget - rows)))

    def drain(self) -> Iterator[dict[int, list[Event]]]:
        """Rounds until every submitted request is done (for scripts and tests)."""
        while self.busy:
            yield self.step()

    def _drop_cancelled(self) -> None:
        self.waiting = deque(s for s in self.waiting if not s.cancelled)
        for slot in [s for s in self.joining if s.cancelled]:
            self.caches.drop(slot.request_id)
            self.joining.remove(slot)
        self._leave([s for s in self.active if s.cancelled])

    def _leave(self, leaving: list[Slot]) -> None:
        if not leaving:
            return
        lengths = self.caches.lengths()
        kept = []
        for i, slot in enumerate(self.active):
            held = slot.run.sequence[:-1]  # the row's cache holds all but the pending token
            reusable = self.prefixes.capacity and not slot.error and lengths[i] == len(held)
            if slot in leaving and reusable:
                kept.append((i, held))
        keep = [i for i, slot in enumerate(self.active) if slot not in leaving]
        self.caches.leave(keep, kept)
        self.active = [self.active[i] for i in keep]

    def _choose(self, slot: Slot, row: int) -> tuple[ProposalContext, Situation | None, int]:
        """The request's context, source and draft length k for this round (its policy's
        choice, priced at its context length; in a batch the round's width may then cap
        how much of it is drafted)."""
        run = slot.run
        hidden, prompt_length = self.caches.row_hidden(row), len(run.prompt_tokens)
        ctx = ProposalContext(run.sequence, run.scorer, run.rng, self.target, hidden)
        ctx.history, ctx.prompt_length = run.history, prompt_length
        run.policy.context = len(run.sequence)
        situation, k = run.policy.choose_among(candidates(slot.proposer, ctx), run.left)
        return ctx, situation, k

    def _draft(
        self,
        slot: Slot,
        ctx: ProposalContext,
        situation: Situation | None,
        k: int,
        cap: int | None,
    ) -> Round:
        """The request's draft for this round: a line of k tokens, or a tree at most k
        deep (asked for, or a source that always branches, where the caches verify trees).
        `cap` (a batch's `_draft_cap`) shortens a k its policy chose, never a fixed one,
        and bounds a tree's nodes."""
        if cap is not None and slot.run.policy.fixed_k is None:
            k = min(k, cap)
        start = time.perf_counter()
        forced = forced_tokens(slot.run, slot.proposer)
        if forced:
            situation, draft = draft_after(slot.run, slot.proposer, ctx, situation, forced, k)
            seconds = time.perf_counter() - start
            return Round(situation, draft, chain(draft.tokens), seconds, forced=len(forced))
        source = situation.source if k else None
        branches = slot.trees or (self.can_tree and getattr(source, "always_tree", False))
        # The round verifies no more nodes than the cap: drafting more is wasted, and a
        # tree of one node is a line's first token (a head's tree costs more to draft).
        budget = slot.tree_nodes if cap is None else min(slot.tree_nodes, cap)
        if k and branches and budget > 1:
            tree = self.engine.draft_tree(source, ctx, k, budget, slot.run.policy)
            draft = None
        else:
            draft = source.propose(ctx, k) if k else None
            tree = chain(draft.tokens[:k] if draft else [])
        return Round(situation, draft, tree, time.perf_counter() - start)

    def _constrain(self, slot: Slot, r: Round) -> Round:
        """The round's draft cut to what the request's grammar allows, with each verify
        row's mask (`RequestRun.constrain`)."""
        tree, masks, refused = slot.run.constrain(r.tree)
        forced = min(r.forced, len(tree))
        return dataclasses.replace(r, tree=tree, masks=masks, refused=refused, forced=forced)

    def _round(self) -> None:
        """The only round loop's body, for a batch and for `Engine.stream`'s one row."""
        chosen = {
            slot.request_id: self._guarded(slot, self._choose, slot, row)
            for row, slot in enumerate(self.active)
        }
        cap = None  # alone, the policy's k stands; a batch drafts no more than it verifies
        if not self.solo:
            cap = self._draft_cap([(s, chosen[s.request_id]) for s in self.active if not s.error])
        drafted = {
            slot.request_id: self._guarded(slot, self._draft, slot, *chosen[slot.request_id], cap)
            for slot in self.active
            if not slot.error
        }
        self._leave([slot for slot in self.active if slot.error])
        if not self.active:
            return
        rounds = [drafted[slot.request_id] for slot in self.active]
        if not self.solo:  # alone, the policy priced its k on the verify-cost curve
            rounds = self._truncate(rounds)
        if any(slot.run.constraint is not None for slot in self.active):
            constrained = {
                slot.request_id: self._guarded(slot, self._constrain, slot, r)
                for slot, r in zip(self.active, rounds)
            }
            self._leave([slot for slot in self.active if slot.error])
            if not self.active:
                return
            rounds = [constrained[slot.request_id] for slot in self.active]
        rows = [[slot.run.sequence[-1], *r.tree.tokens] for slot, r in zip(self.active, rounds)]
        trees = [r.tree for r in rounds]
        lines = all(tree.is_chain for tree in trees)
        round_start = time.perf_counter()
        logits = self.caches.take_launched(rows)  # launched last round (`_launches`)
        launched = logits is not None
        if logits is None:
            logits = self.caches.verify(rows) if lines else self.caches.verify_tree(rows, trees)
        processed = [
            slot.run.scorer.process_tree(logits[i, : len(row)], slot.run.sequence, r.tree)
            for i, (slot, r, row) in enumerate(zip(self.active, rounds, rows))
        ]
        # What decides: the processed rows masked by each request's grammar (logprobs
        # report the model's own distribution, unmasked, as OpenAI's do).
        decided = [
            slot.run.masked(p, r.masks) for slot, p, r in zip(self.active, processed, rounds)
        ]
        whole = None if self.solo else batch_greedy_reads([s.run for s in self.active], logits)
        if whole is None:
            reads = [greedy_reads(slot.run, p) for slot, p in zip(self.active, decided)]
        else:
            reads = [whole]
        launching = self._launches(rows)
        if launching:  # the next pass computes while the host does this round's work
            launch_next(self.caches, decided, reads)
        mx.eval(decided, reads)
        if whole is not None:
            reads = split_reads(whole, [len(row) for row in rows])
        verify_seconds = time.perf_counter() - round_start
        accepted = [
            self._guarded(slot, self._accept, slot, r, rows_decided, read) or ([], -1)
            for slot, r, rows_decided, read in zip(self.active, rounds, decided, reads)
        ]
        if lines:
            # The price of a width includes the cache work after a ragged acceptance
            # (a few ms over 8 rows here), which only wide rounds pay: `keep` evaluates it.
            self.caches.keep([1 + len(path) for path, _ in accepted], max(map(len, rows)))
        else:
            self.caches.keep_tree([path for path, _ in accepted], max(map(len, rows)))
        if not (self.solo or launched or launching):  # a wait, or two passes: no pass's cost
            self.pass_cost.observe(
                len(rows), max(map(len, rows)), time.perf_counter() - round_start
            )
        pending = [  # logprobs, for the requests that asked
            None if slot.error else slot.run.pending_logprobs(r.tree, rows_processed, *kept)
            for slot, r, rows_processed, kept in zip(self.active, rounds, processed, accepted)
        ]
        logprobs = read_logprobs([slot.run for slot in self.active], pending)
        batch = len(self.active)
        for slot, r, (path, own_token), entries in zip(self.active, rounds, accepted, logprobs):
            if slot.error:
                continue
            if not r.tree.is_chain:
                slot.run.record.tree_rounds += 1
                slot.run.record.tree_nodes += len(r.tree)
            price = one_step if launched and self.solo else None
            if self.solo and not launched:
                price = self._price_alone(slot.run, r.tree, verify_seconds)
            elif not self.solo:
                sizes = slot.run.record.batch_sizes
                sizes.extend([0] * (batch + 1 - len(sizes)))
                sizes[batch] += 1
            self._guarded(
                slot, self._advance, slot, r, path, own_token, round_start, price, entries
            )

    def _launches(self, rows: list[list[int]]) -> bool:
        """Whether the next round's pass may start now (`launches_next`, every row), on
        caches that can take it back, with no row about to join: a join takes it back."""
        if not self.caches.can_launch:
            return False
        if self.waiting and len(self.joining) + len(self.active) < self.max_batch:
            return False
        if any(self.caches.unfed(s.request_id) <= self.prefill_chunk for s in self.joining):
            return False
        return all(launches_next(s.run, [row]) for s, row in zip(self.active, rows))

    def _price_alone(
        self, run: RequestRun, tree: DraftTree, verify_seconds: float
    ) -> Callable[[float], float]:
        """A pass that was the request's alone: its policy learns what it cost, and the
        round's price in plain target steps goes to the run record's speedup estimate."""
        run.policy.observe_verify(len(tree) + 1, verify_seconds)
        cost = self.engine.round_cost(run.policy, len(tree) + 1)
        return partial(round_steps, verify_seconds=verify_seconds, verify_cost=cost)

    def _accept(
        self, slot: Slot, r: Round, processed: mx.array, reads: dict[str, mx.array | list]
    ) -> tuple[list[int], int]:
        """A proposer that learns from the target's choices (suffix's history hits,
        lookahead's pool) sees them, then the run accepts. `reads`: `greedy_reads`,
        evaluated."""
        run = slot.run
        choices, ties = (as_list(reads.get(name)) for name in ("argmax", "near_ties"))
        if r.tree.tokens and r.situation and hasattr(r.situation.source, "verified"):
            r.situation.source.verified(r.tree, choices or run.scorer.greedy_tokens(processed))
        return run.accept(r.tree, processed, r.draft, choices, ties, r.refused)

    def _width(self, rows: list[tuple[Slot, Situation | None, int]], floor: int = 0) -> int:
        """The round's one width W for rows of (request, source, draft length): the pass
        is as wide as its widest row, so a long draft is paid by every row. A request
        that fixed its k is never cut (W is at least its k), nor are `floor` tokens (a
        grammar's forced ones); a row with no draft costs a column."""
        fixed = (k for s, _, k in rows if s.run.policy.fixed_k is not None)
        floor = max(floor, *fixed, 0)
        if floor == 0 and self.pass_cost.wants_plain(len(rows)):
            return 0  # re-time a plain pass over these rows (see PassCost)
        estimates = [
            (s.run.policy.acceptance_rate(situation) if situation else 0.0, k)
            for s, situation, k in rows
        ]
        return choose_width(estimates, floor, self.pass_cost, self.row_floor)

    def _draft_cap(self, choices: list[tuple[Slot, tuple]]) -> int:
        """How many tokens a row whose k is its policy's need draft: the width its k
        would get (drafts are never longer than k, and the width only narrows with them),
        at least 1, so that a row cut to W = 0 still learns from its first draft token.
        Drafting k and cutting after cost a drafter head or a draft model k forwards a
        row in every round the batch ran plain."""
        return max(1, self._width([(s, situation, k) for s, (_, situation, k) in choices]))

    def _truncate(self, rounds: list[Round]) -> list[Round]:
        """Cut every row's draft to the round's one width W (`_width`): a line to its
        first W tokens, a tree to its W likeliest nodes (`cut_tree`)."""
        # The grammar's forced tokens are all but certain: never cut (a floor, as a
        # fixed k is).
        forced = max(r.forced for r in rounds)
        rows = [(s, r.situation, len(r.tree)) for s, r in zip(self.active, rounds)]
        width = self._width(rows, forced)
        return [
            dataclasses.replace(
                r,
                tree=cut_tree(r.tree, width),
                unverified_first=first_guess(r.tree) if width == 0 else None,
            )
            if len(r.tree) > width
            else r
            for r in rounds
        ]

    def _advance(
        self,
        slot: Slot,
        r: Round,
        path: list[int],
        own_token: int,
        round_start: float,
        price: Callable[[float], float] | None,
        logprobs: list[TokenLogprob] | None,
    ) -> None:
        run = slot.run
        if r.unverified_first is not None and r.situation is not None:
            run.policy.observe_unverified(r.situation, r.unverified_first == own_token)
        slot.events.extend(
            run.advance(
                r.tree,
                path,
                own_token,
                r.situation,
                r.draft_seconds,
                round_start,
                price,
                logprobs,
                r.forced,
            )
        )
        if run.finished is None:
            return
        hidden = self.caches.row_hidden(self.active.index(slot))
        if hidden is not None:
            # The last round's hidden states, for the proposer's next request to build on.
            ctx = ProposalContext(run.sequence, run.scorer, run.rng, self.target, hidden)
            slot.proposer.observe(ctx)
        slot.events.append(self.engine.finish(run))

    def _guarded(self, slot: Slot, step, *args):
        """Run one request's own step; if it fails, that request alone ends."""
        try:
            return step(*args)
        except Exception as error:  # any failure of this request's own code
            slot.error, slot.events = error, []
            self.failed[slot.request_id] = error
            return None
