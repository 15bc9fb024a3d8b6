"""A batch's next pass launched before its rows' tokens reach the host
(`mlxspec.batch.launch`): rows that join, end and are cancelled while passes are launched
each get their plain greedy tokens, and every launched pass a change did not run over is
taken back, so the caches (and the prefixes they hand on) hold each row's tokens alone."""

from __future__ import annotations

import sys

from lossless import plain_greedy
from test_lossless import CPU_LIKE_COST
from tiny_models import byte_tokenizer, tiny_model

from mlxspec.batch.caches import BatchCaches
from mlxspec.batch.scheduler import Scheduler
from mlxspec.decoding.engine import Engine, GenerationSettings
from mlxspec.events import Done, Step
from mlxspec.models.target import LaunchedPass

PROMPTS = [
    list(b"Once upon a time, in a land far away, "),
    list(b"abc"),
    list(b"The quick brown fox jumps over the lazy dog"),
    list(b"xyz xyz"),
    list(b"hello there, "),
    list(b"A long prompt that joins over several prefill chunks of four tokens."),
]


def plain(tokens: int, stop: list[str] | None = None) -> GenerationSettings:
    return GenerationSettings(max_tokens=tokens, k=0, stop=stop or [])


def test_rows_joining_and_leaving_around_launched_passes_stay_plain_greedy(monkeypatch):
    """Requests join late (a pass launched for a batch they were not in), end by a stop
    string and are cancelled (a pass launched for rows that leave), and end by length:
    every request's tokens are its plain greedy ones, and the rows that left hand on
    prefixes the next request reuses as if no pass had been launched."""
    taken, taken_back = [], []  # took a launched pass; the calls that took one back
    take, drop = LaunchedPass.take, LaunchedPass.drop

    def counting_take(self, cache, tokens):
        logits = take(self, cache, tokens)
        taken.append(logits is not None)
        return logits

    def counting_drop(self, cache):
        if self.pending:
            taken_back.append(sys._getframe(1).f_code.co_name)
        drop(self, cache)

    monkeypatch.setattr(LaunchedPass, "take", counting_take)
    monkeypatch.setattr(LaunchedPass, "drop", counting_drop)
    model = tiny_model("llama", seed=7)
    tokenizer = byte_tokenizer()
    engine = Engine(model, tokenizer, "llama", verify_cost=CPU_LIKE_COST)
    # Room to keep every row that leaves, so that each one's prefix can be checked.
    caches = BatchCaches(model, prefix_capacity=len(PROMPTS) + 2)
    scheduler = Scheduler(engine, max_batch=5, caches=caches)
    scheduler.prefill_chunk = 4  # the long prompt joins over several rounds
    asked = {
        scheduler.submit(PROMPTS[0], plain(30)): (PROMPTS[0], 30),
        scheduler.submit(PROMPTS[1], plain(12)): (PROMPTS[1], 12),
        scheduler.submit(PROMPTS[2], plain(40, stop=["2"])): (PROMPTS[2], 40),
    }
    cancelled = scheduler.submit(PROMPTS[3], plain(40))
    # round: (prompt, tokens); the first joins at once, into a batch with a launched pass
    late = {6: (PROMPTS[1], 20), 9: (PROMPTS[5], 16), 12: (PROMPTS[4], 14)}
    done: dict[int, Done] = {}
    steps: dict[int, int] = {}
    for number, out in enumerate(scheduler.drain()):
        for request_id, got in out.items():
            steps[request_id] = steps.get(request_id, 0) + sum(isinstance(e, Step) for e in got)
            done.update((request_id, e) for e in got if isinstance(e, Done))
        if number in late:
            prompt, tokens = late[number]
            asked[scheduler.submit(prompt, plain(tokens))] = late[number]
        if number == 7:
            scheduler.cancel(cancelled)
    assert sum(taken) >= 20, taken  # the mechanism under test ran
    assert cancelled not in done and steps[cancelled] >= 5
    eos = set(tokenizer.eos_token_ids)
    for request_id, (prompt, tokens) in asked.items():
        reference = list(plain_greedy(model, prompt, tokens, eos))
        got = list(done[request_id].token_ids)
        if done[request_id].record.finish_reason == "stop":
            assert got == reference[: len(got)] and len(got) < tokens, request_id
        else:
            assert got == reference, request_id
    assert not scheduler.busy and scheduler.target.rows == 0
    # Every row that left was kept whole (its cache held its tokens alone: an entry, or a
    # prefix of a longer one that superseded it); one that left with a pass launched
    # (ended by its stop string) hands on its tokens, which the next request reuses as if
    # no pass had been launched.
    kept = [k.tokens for k in scheduler.prefixes.kept]
    for request_id, (prompt, _) in asked.items():
        held = [*prompt, *done[request_id].token_ids][:-1]
        assert any(k[: len(held)] == held for k in kept), request_id
    cut = list(PROMPTS[3])  # the cancelled row too, with what it had generated
    assert any(k[: len(cut)] == cut and len(k) >= len(cut) + 5 for k in kept)
    (stopped,) = [i for i, d in done.items() if d.record.finish_reason == "stop"]
    follow_up = [*asked[stopped][0], *done[stopped].token_ids, *b" And then"]
    again = scheduler.submit(follow_up, plain(12))
    reused = [e for out in scheduler.drain() for e in out.get(again, [])][-1]
    held = len(asked[stopped][0]) + len(done[stopped].token_ids) - 1
    assert reused.record.reused_prompt_tokens >= held
    assert list(reused.token_ids) == list(plain_greedy(model, follow_up, 12, eos))
    # Taken back by a join, and by leaves (which read the rows' lengths first).
    assert {"join", "lengths"} <= set(taken_back), taken_back


def test_a_batch_that_cannot_take_a_pass_back_launches_none():
    """Rows whose proposer reads hidden states, recurrent layers and a sharded batch (its
    `PlannedCaches`) launch nothing: the pass could not be taken back, or replayed."""
    from mlxspec.distributed.batch import PlannedCaches

    caches = BatchCaches(tiny_model("llama", seed=7), prefix_capacity=2)
    assert caches.can_launch
    caches.captures = [None, (1,)]
    assert not caches.can_launch
    assert PlannedCaches.can_launch is False
    assert not BatchCaches(tiny_model("lfm2", seed=7), prefix_capacity=2).can_launch
