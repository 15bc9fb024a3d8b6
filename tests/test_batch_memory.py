"""The batch's KV bound: a waiting request joins only while the KV the batch may come
to hold fits (`Scheduler.kv_budget`, `serve --kv-memory`); kept prefixes give way first,
and a request alone always runs."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest
from lossless import assert_lossless, plain_greedy
from test_batch import sample_prompts, scheduler_for
from test_batch_server import ask, ran_beside_others
from test_lossless import MAX_TOKENS
from test_server import ECHO, TinyProvider, direct_answer, serving
from tiny_models import VOCAB

from mlxspec.batch import target as batch_target
from mlxspec.batch.memory import GB, kv_budget
from mlxspec.batch.target import cache_columns
from mlxspec.decoding.engine import GenerationSettings
from mlxspec.events import Done
from mlxspec.server import ServerLimits


def row_bytes(scheduler, tokens: int) -> float:
    """What the batch reserves for one row of `tokens` (prompt + max_tokens)."""
    columns = cache_columns(tokens)
    return sum(
        b * (columns if cap is None else min(columns, cap)) for b, cap in scheduler.kv_layout
    )


def learned_scheduler(budget_rows: float, seed: int = 4, family: str = "llama"):
    """A batch that has learned the bytes a token takes (from one short request), its
    budget then set to `budget_rows` rows of MAX_TOKENS + 30 tokens."""
    scheduler = scheduler_for(family, seed=seed)
    scheduler.kv_budget = 1 << 40
    scheduler.submit([1, 2, 3], GenerationSettings(max_tokens=2))
    list(scheduler.drain())
    assert scheduler.kv_per_token > 0
    scheduler.kv_budget = int(budget_rows * row_bytes(scheduler, MAX_TOKENS + 30))
    return scheduler


def held_bytes(scheduler) -> int:
    """The bytes the batch's KV caches and kept prefixes really hold."""
    target = scheduler.target
    layers = [target.cache[i] for i in target.attention] if target.cache else []
    kept = [layer for k in scheduler.prefixes.kept for layer in k.cache]
    return sum(c.keys.nbytes + c.values.nbytes for c in [*layers, *kept] if c.keys is not None)


def run_under_budget(scheduler, prompts) -> tuple[dict, int]:
    """Drain, checking after every round that the batch's KV stays within its budget
    whenever more than one request holds a row; returns the outputs and the most rows."""
    settings = GenerationSettings(max_tokens=MAX_TOKENS, k=2)
    ids = {scheduler.submit(p, settings, "lookup"): p for p in prompts}
    outputs, most = {}, 0
    for out in scheduler.drain():
        rows = len(scheduler.joining) + len(scheduler.active)
        most = max(most, rows)
        if rows > 1:
            assert scheduler.kv_reserved() <= scheduler.kv_budget
            assert held_bytes(scheduler) <= scheduler.kv_reserved()  # the count is true
        for request_id, events in out.items():
            if isinstance(events[-1], Done):
                outputs[request_id] = list(events[-1].token_ids)
    assert sorted(outputs) == sorted(ids), "a request was lost"
    model = scheduler.engine.target.model
    for request_id, prompt in ids.items():
        reference = plain_greedy(model, prompt, MAX_TOKENS, {VOCAB - 1})
        assert_lossless(model, prompt, reference, outputs[request_id], f"{request_id}")
    return outputs, most


def test_requests_wait_for_kv_room_and_none_is_lost():
    prompts = [p[:25] for p in sample_prompts(3)]  # every row spans <= MAX_TOKENS + 25
    _, most = run_under_budget(learned_scheduler(2.5), prompts)
    assert most == 2  # room for two such rows, not three
    _, most = run_under_budget(learned_scheduler(8), prompts)
    assert most > 2  # the bound, not something else, held the batch to two


def test_kept_prefixes_give_way_to_a_waiting_request():
    scheduler = learned_scheduler(2.05, seed=5)  # two rows, and little room besides
    evicted = []
    evict = scheduler.caches.evict
    scheduler.caches.evict = lambda tokens: (evicted.append(tokens), evict(tokens))
    prompts = [p[:25] for p in sample_prompts(4)]
    run_under_budget(scheduler, prompts[:2])  # both finish: their rows are kept
    assert scheduler.prefixes.kept
    run_under_budget(scheduler, prompts[2:4])  # two rows fill the budget: the pool yields
    assert evicted, "no kept prefix had to go: the test tests nothing"


def test_window_layers_are_counted_as_the_columns_they_keep(monkeypatch):
    """A sliding-window layer keeps its window (and slack), not the context: a long row
    reserves little more in it than a short one, the global layers grow with the
    context, and what the batch really holds stays within what it reserved."""
    monkeypatch.setattr(batch_target, "WINDOW_SLACK", 3)
    scheduler = learned_scheduler(2.5, seed=8, family="gemma3_text")
    windowed = [cap for _, cap in scheduler.kv_layout if cap is not None]
    assert windowed and len(windowed) < len(scheduler.kv_layout)
    full = scheduler.kv_per_token * cache_columns(5000)
    long_row = SimpleNamespace(run=SimpleNamespace(sequence=[0] * 4000, left=1000))
    assert scheduler.kv_reserved(long_row) < 0.6 * full  # 2 of 3 tiny gemma layers: windows
    _, most = run_under_budget(scheduler, [p[:25] for p in sample_prompts(3)])
    assert most == 2


def test_a_request_bigger_than_the_budget_still_runs_alone():
    scheduler = learned_scheduler(0.1, seed=6)
    _, most = run_under_budget(scheduler, [p[:20] for p in sample_prompts(5)[:3]])
    assert most == 1


def test_serve_kv_memory_bounds_the_batch_and_health_reports_it():
    assert kv_budget(0) is None and kv_budget(2) == 2 * GB
    assert kv_budget(None) is None or kv_budget(None) > 0  # a share of this machine
    limits = ServerLimits(max_batch=4, max_waiting=8, kv_memory=1e-6)  # ~1 row of a tiny llama
    prompts = [f"{word} {word} {ECHO}" for word in ("one", "two", "three")]
    with serving(TinyProvider(), limits=limits) as url:
        with ThreadPoolExecutor(3) as pool:  # at once: the bound, not the clients, serialises
            answers = list(pool.map(lambda p: ask(url, p, max_tokens=12), prompts))
        health = httpx.get(f"{url}/health").json()
    for answer, prompt in zip(answers, prompts):
        solo = direct_answer([{"role": "user", "content": prompt}], 12)
        assert answer.choices[0].message.content == solo
        assert not ran_beside_others(answer)
    assert health["kv_memory"]["budget_gb"] == pytest.approx(1e-6, abs=0.01)
    assert health["kv_memory"]["reserved_gb"] >= 0


def test_a_sharded_batchs_ranks_let_the_same_prefixes_go():
    """On a sharded target every rank keeps its own prefix pool and must offer the same
    prefixes: rank 0's evictions go out in its plans (replayed here in one process,
    through JSON as on the wire), or a later prompt would reuse a prefix on one rank
    and prefill it on another."""
    import json

    from mlxspec.batch.scheduler import Scheduler
    from mlxspec.distributed.batch import BatchFollower, PlannedCaches

    engine = scheduler_for("llama", seed=7).engine
    model = engine.target.model
    follower = BatchFollower(model, 4, rank=1)
    evictions = []

    class Loopback:
        watchdog = SimpleNamespace(disarm=lambda: None)

        def announce(self, plan, what: str) -> None:
            evictions.extend(call for call in plan["plan"] if call[0] == "evict")
            follower.replay(json.loads(json.dumps(plan)), lambda rows, round_: None)

    scheduler = Scheduler(engine, 4, PlannedCaches(model, 4, Loopback()), kv_budget=1 << 40)
    prompts = [p[:25] for p in sample_prompts(8)]
    run_under_budget(scheduler, prompts[:2])  # learns the bytes a token takes; rows kept
    scheduler.kv_budget = int(2.05 * row_bytes(scheduler, MAX_TOKENS + 30))
    run_under_budget(scheduler, prompts[2:4])
    assert evictions, "no kept prefix had to go: the test tests nothing"
    kept = [k.tokens for k in scheduler.prefixes.kept]
    assert [k.tokens for k in follower.caches.prefixes.kept] == kept
