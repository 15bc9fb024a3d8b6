"""The next round's pass launched before this round's token is known on the host
(`Target.launch`, `Scheduler._launches_next`): a plain greedy request alone gets the same
tokens and events as without it, and a request that ends or is closed takes the launched
pass back, computing nothing more."""

from __future__ import annotations

import mlx.core as mx
import pytest
from lossless import plain_greedy
from test_lossless import CPU_LIKE_COST
from tiny_models import byte_tokenizer, tiny_model

from mlxspec.batch.scheduler import Scheduler
from mlxspec.batch.single import SingleCaches
from mlxspec.decoding.engine import Engine, GenerationSettings
from mlxspec.events import Done, Step
from mlxspec.models.target import Target
from mlxspec.proposers import PromptLookup
from mlxspec.sampling import SamplingSettings

PROMPT = list(b"Once upon a time, in a land far away, ")


def comparable(events) -> list[tuple]:
    """What a front end shows of each event: kinds, tokens and text; a Step's draft
    counts (not its seconds); Done's text, tokens and finish reason."""
    out = []
    for event in events:
        if isinstance(event, Step):
            out.append(("step", event.proposer, event.drafted, event.accepted))
        elif isinstance(event, Done):
            out.append(("done", event.text, event.token_ids, event.record.finish_reason))
        else:
            out.append((type(event).__name__, event.tokens, event.text))
    return out


@pytest.fixture
def launches(monkeypatch) -> list[bool]:
    """Records whether each round's verify took a launched pass."""
    taken = []
    original = Target.take_launched

    def recording(self, tokens):
        logits = original(self, tokens)
        taken.append(logits is not None)
        return logits

    monkeypatch.setattr(Target, "take_launched", recording)
    return taken


def unlaunched(monkeypatch) -> None:
    monkeypatch.setattr(SingleCaches, "can_launch", property(lambda self: False))


def consistent(target: Target) -> bool:
    """The cache holds exactly the tokens the target says it holds (no launched pass)."""
    return all(c.offset == len(target.cached_tokens) for c in target.cache)


@pytest.mark.parametrize(
    "family, settings",
    [
        ("llama", GenerationSettings(max_tokens=40, k=0)),
        ("qwen3", GenerationSettings(max_tokens=40, k=0, stop=["o"])),
        (
            "llama",
            GenerationSettings(
                max_tokens=40, k=0, sampling=SamplingSettings(repetition_penalty=1.3)
            ),
        ),
    ],
    ids=["llama", "qwen3-stop-string", "llama-repetition-penalty"],
)
def test_a_launched_pass_gives_the_same_tokens_and_events(family, settings, launches, monkeypatch):
    model = tiny_model(family, seed=7)
    launched = list(Engine(model, byte_tokenizer(), family).stream(PROMPT, settings))
    assert sum(launches) >= 5  # the mechanism under test ran
    unlaunched(monkeypatch)
    engine = Engine(model, byte_tokenizer(), family)
    assert comparable(launched) == comparable(engine.stream(PROMPT, settings))
    assert consistent(engine.target)
    if family == "llama" and settings.sampling.repetition_penalty is None:
        eos = set(byte_tokenizer().eos_token_ids)
        assert list(launched[-1].token_ids) == plain_greedy(model, PROMPT, 40, eos)


def test_a_request_that_ends_takes_its_launched_pass_back(launches):
    """Ended by a stop string after some launched rounds, the cache holds the request's
    tokens but the pending one, and the next turn reuses them as if no pass had been
    launched."""
    model = tiny_model("llama", seed=7)
    engine = Engine(model, byte_tokenizer(), "llama", verify_cost=CPU_LIKE_COST)
    done = list(engine.stream(PROMPT, GenerationSettings(max_tokens=40, k=0, stop=["C"])))[-1]
    assert done.record.finish_reason == "stop" and len(done.token_ids) > 5 and any(launches)
    assert consistent(engine.target)
    follow_up = [*PROMPT, *done.token_ids, *b" And then"]
    settings = GenerationSettings(max_tokens=12, k=0)
    reused = list(engine.stream(follow_up, settings))[-1]
    fresh = list(Engine(model, byte_tokenizer(), "llama").stream(follow_up, settings))[-1]
    assert reused.record.reused_prompt_tokens > len(PROMPT)
    assert reused.token_ids == fresh.token_ids


def test_closing_a_stream_computes_no_further_round(launches, monkeypatch):
    """The reader stops after a few rounds: the pass launched for the next round is taken
    back (the cache holds the request's tokens so far) and no forward runs after."""
    model = tiny_model("llama", seed=7)
    engine = Engine(model, byte_tokenizer(), "llama")
    forwards = []
    original = type(model).__call__
    monkeypatch.setattr(
        type(model),
        "__call__",
        lambda self, *a, **kw: forwards.append(1) or original(self, *a, **kw),
    )
    stream = engine.stream(PROMPT, GenerationSettings(max_tokens=100, k=0))
    steps = 0
    for event in stream:
        steps += isinstance(event, Step)
        if steps == 5:
            break
    before = len(forwards)
    stream.close()
    assert any(launches) and len(forwards) == before
    assert consistent(engine.target)
    assert len(engine.target.cached_tokens) == len(PROMPT) + 5 - 1  # all but the pending


def test_a_launched_pass_over_another_token_is_dropped():
    """`take_launched` of tokens the pass did not run over drops it: the cache is as
    before the launch, and a verify then gives the logits it gives without one."""
    model = tiny_model("llama", seed=7)
    target, plain = Target(model), Target(model)
    for t in (target, plain):
        t.fill(PROMPT)
    target.launch(mx.array([7]))
    assert target.take_launched([8]) is None
    assert consistent(target) and target.cached_tokens == plain.cached_tokens
    logits, _ = target.verify([8])
    expected, _ = plain.verify([8])
    assert mx.array_equal(logits, expected).item()
    target.launch(mx.array([9]))
    taken = target.take_launched([9])
    assert mx.array_equal(taken, plain.verify([9])[0]).item()
    assert target.cached_tokens == plain.cached_tokens and consistent(target)


def test_near_ties_read_with_the_logits_count_every_kept_row(monkeypatch):
    """In a batch, each row's near ties are read in the round's one evaluation
    (`greedy_reads`); with every choice a near tie (NEAR_TIE raised), a request's count
    is every token it kept: drafts accepted and its own, a round's refused drafts not."""
    from mlxspec import sampling

    monkeypatch.setattr(sampling, "NEAR_TIE", 1e9)
    model = tiny_model("llama", seed=7)
    engine = Engine(model, byte_tokenizer(), "llama", verify_cost=CPU_LIKE_COST)
    engine.add_proposer(PromptLookup("lookup", ngram_max=3, ngram_min=1, k_max=4))
    scheduler = Scheduler(engine, max_batch=2)
    repeated = [*PROMPT, *PROMPT]
    ids = [
        scheduler.submit(PROMPT, GenerationSettings(max_tokens=12), "none"),
        scheduler.submit(repeated, GenerationSettings(max_tokens=24, k=3), "lookup"),
    ]
    done = {i: e for out in scheduler.drain() for i, es in out.items() for e in es}
    records = [done[i].record for i in ids]
    assert records[1].drafted > records[1].accepted > 0  # kept and refused drafts both
    for record, i in zip(records, ids):
        assert record.near_ties == len(done[i].token_ids) > 0


def test_what_the_host_reads_is_scheduled_before_the_next_pass(monkeypatch):
    """MLX signals every array of one `async_eval` when all of it is done: a round's reads
    scheduled with the next pass (its input) made their reading wait for that whole pass,
    the overlap the launch is for. Each launched pass must follow an `async_eval` of the
    round's reads of its own."""
    calls: list[str] = []
    original_async_eval, original_launch = mx.async_eval, Target.launch

    def recording_async_eval(*arrays):
        calls.append("pass" if calls and calls[-1] == "launching" else "reads")
        return original_async_eval(*arrays)

    def recording_launch(self, token, chosen=None):
        calls.append("launching")
        return original_launch(self, token, chosen)

    monkeypatch.setattr(mx, "async_eval", recording_async_eval)
    monkeypatch.setattr(Target, "launch", recording_launch)
    engine = Engine(tiny_model("llama"), byte_tokenizer(), "llama", verify_cost=CPU_LIKE_COST)
    list(engine.stream(PROMPT, GenerationSettings(max_tokens=12, k=0)))
    passes = [i for i, call in enumerate(calls) if call == "launching"]
    assert len(passes) >= 5, calls
    assert all(i > 0 and calls[i - 1] == "reads" for i in passes), calls
