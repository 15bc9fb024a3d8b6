"""Requests that end early: cancelled while they wait for a slot, while they prefill
(after the first chunk, after a later one), while they generate; alone, beside others,
and on a sharded batch's rank 0 with a follower replaying its plans.

After each cancel nothing more is computed for the request: no prefill chunk, no verify
row and no draft of its proposer comes after it (counted, not timed); its slot, its
prefill cache and its proposer copy are gone; the others' outputs are their solo
greedy outputs; and a drained batch holds nothing, so a sharded rank 0 says idle.
"""

from __future__ import annotations

import gc
import json
import weakref
from types import SimpleNamespace

import pytest
from lossless import assert_lossless, plain_greedy
from test_batch import sample_prompts, scheduler_for
from test_lossless import Oracle
from tiny_models import VOCAB

from mlxspec.batch.scheduler import Scheduler
from mlxspec.decoding.engine import GenerationSettings
from mlxspec.distributed.batch import BatchFollower, PlannedCaches
from mlxspec.events import Done

MAX_TOKENS = 24
LONG = 3  # sample_prompts' 30-token prompt: 8 prefill chunks of 4


class Passes:
    """Every pass the caches run, in order: ("advance", request id) for a prefill chunk,
    ("verify", [request ids of its rows]) for a verify. The counter hook the cancel
    tests read: what ran for a request after it was cancelled."""

    def __init__(self, scheduler: Scheduler):
        self.log: list[tuple[str, object]] = []
        caches = scheduler.caches
        advance, verify = caches.advance, caches.verify

        def advanced(request_ids, chunk, together=()):
            self.log += [("advance", request_id) for request_id in request_ids]
            return advance(request_ids, chunk, together)

        def verified(rows):
            self.log.append(("verify", [s.request_id for s in scheduler.active]))
            return verify(rows)

        caches.advance, caches.verify = advanced, verified

    def of(self, request_id: int, since: int = 0) -> list[str]:
        """The passes that ran for `request_id` from log entry `since` on."""
        return [
            kind
            for kind, who in self.log[since:]
            if who == request_id or (isinstance(who, list) and request_id in who)
        ]


def sharded(scheduler: Scheduler) -> tuple[Scheduler, BatchFollower, list[dict]]:
    """`scheduler`'s engine on rank 0's PlannedCaches, each plan replayed at once by a
    follower (through JSON, as on the wire); also the plans sent."""
    model = scheduler.engine.target.model
    follower, plans = BatchFollower(model, 2, rank=1), []

    class Loopback:
        watchdog = SimpleNamespace(disarm=lambda: None)

        def announce(self, plan, what: str) -> None:
            plans.append(json.loads(json.dumps(plan)))
            follower.replay(plans[-1], lambda rows, round_: None)

    leader = Scheduler(scheduler.engine, 2, PlannedCaches(model, 2, Loopback()))
    leader.prefill_chunk = scheduler.prefill_chunk
    return leader, follower, plans


def stage_reached(
    scheduler: Scheduler, passes: Passes, request_id: int, stage: str, chunks: int
) -> bool:
    """Whether `request_id` is where the test cancels it: still waiting, prefilling with
    `chunks` chunks fed, or a row of the batch for `chunks` rounds."""
    if stage == "waiting":
        return any(s.request_id == request_id for s in scheduler.waiting)
    ran = passes.of(request_id)
    if stage == "prefilling":
        return request_id in scheduler.caches.prefills and ran.count("advance") == chunks
    active = any(s.request_id == request_id for s in scheduler.active)
    return active and ran.count("verify") == chunks


CASES = [
    ("waiting", 0, "a slot is free only after the first two finish"),
    ("prefilling", 1, "its first chunk is in"),
    ("prefilling", 3, "a later chunk is in"),
    ("active", 2, "two rounds into its answer"),
]


@pytest.mark.parametrize("where", ["one process", "sharded"])
@pytest.mark.parametrize("beside", [False, True], ids=["alone", "beside others"])
@pytest.mark.parametrize("stage,chunks,why", CASES, ids=[f"{s}-{c}" for s, c, _ in CASES])
def test_a_request_cancelled_at_any_stage_leaves_nothing_behind(stage, chunks, why, beside, where):
    scheduler = scheduler_for("llama", seed=4, max_batch=2)
    follower = None
    if where == "sharded":
        scheduler, follower, plans = sharded(scheduler)
    model, eos = scheduler.engine.target.model, {VOCAB - 1}
    prompts = sample_prompts(5)
    settings = GenerationSettings(max_tokens=MAX_TOKENS, k=3)
    others = [0, 1] if beside or stage == "waiting" else []
    references = {i: plain_greedy(model, prompts[i], MAX_TOKENS, eos) for i in [*others, LONG]}
    passes = Passes(scheduler)
    ids = {
        i: scheduler.submit(prompts[i], settings, Oracle(len(prompts[i]), references[i]))
        for i in others
    }
    # The request cancelled: a private copy of a named proposer (whose state must go).
    victim = scheduler.submit(prompts[LONG], settings, "lookup")
    copy = weakref.ref(next(s for s in scheduler.waiting if s.request_id == victim).proposer)
    events: dict[int, list] = {}
    cancelled_at = None
    for out in scheduler.drain():
        for request_id, got in out.items():
            events.setdefault(request_id, []).extend(got)
        if cancelled_at is None and stage_reached(scheduler, passes, victim, stage, chunks):
            scheduler.cancel(victim)
            cancelled_at = len(passes.log)
            said = len(events.get(victim, []))
    assert cancelled_at is not None, f"never reached: {why}"
    assert passes.of(victim, since=cancelled_at) == []  # nothing more computed for it
    if stage != "waiting":
        assert passes.of(victim)  # it did run before the cancel
    assert len(events.get(victim, [])) == said  # and nothing more said for it
    assert not any(isinstance(e, Done) for e in events.get(victim, []))
    gc.collect()
    assert copy() is None  # its proposer copy, and that copy's state, went with it
    assert scheduler.caches.prefills == {} and scheduler.caches.empty
    assert not scheduler.busy and scheduler.target.rows == 0
    for i, request_id in ids.items():
        done = events[request_id][-1]
        assert_lossless(model, prompts[i], references[i], list(done.token_ids), f"row {i}")
    if follower is not None:
        assert follower.caches.prefills == {} and follower.caches.empty
        assert plans[-1]["idle"]  # rank 0 told the others it went idle
        kept = [k.tokens for k in scheduler.prefixes.kept]
        assert [k.tokens for k in follower.caches.prefixes.kept] == kept
