"""State that belongs to one row of a batch: its proposer and that proposer's private
state, its policy, its sampling generator and seed, its stop strings, its history reads.

Each request runs alone, then with others from the start and joined into their running
batch: its drafts, acceptance counts, seeded samples (of the target and of a draft
model) and text must be the same every time. Every row fixes its k, so that no round's
width cuts a draft and whatever differs comes from state one row took from another.
"""

from __future__ import annotations

import dataclasses
import random

import mlx.core as mx
import pytest
from test_lossless import CPU_LIKE_COST
from tiny_models import byte_tokenizer, tiny_model

from mlxspec.batch.rows import batch_greedy_reads, greedy_reads, private_copy, split_reads
from mlxspec.batch.scheduler import Scheduler
from mlxspec.decoding.engine import Engine, GenerationSettings
from mlxspec.events import Done
from mlxspec.proposers import DraftModel, PromptLookup, truncated_model
from mlxspec.proposers.suffix import SuffixProposer
from mlxspec.sampling import SamplingSettings, TokenScorer
from mlxspec.suffix.store import HistoryStore

rng = random.Random(43)
PHRASES = [[rng.randrange(97, 123) for _ in range(5)] for _ in range(4)]
# Prompts whose own tokens and the history both give suffix decoding matches.
PROMPTS = [phrase * 3 + [rng.randrange(97, 123) for _ in range(4)] for phrase in PHRASES]


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:
    """Suffix decoding over a fixed history (the engine feeds it nothing, so every run
    reads the same documents) and prompt lookup."""
    store = HistoryStore(tmp_path_factory.mktemp("history"))
    model = tiny_model("llama", seed=7)
    engine = Engine(model, byte_tokenizer(), "llama", verify_cost=CPU_LIKE_COST)
    for prompt in PROMPTS:  # what the model said after each prompt, and a wrong version
        said = list(engine.stream(prompt, GenerationSettings(max_tokens=30, k=0)))[-1]
        store.add([*prompt, *said.token_ids])
        store.add([*prompt, *[(t + 1) % 256 for t in said.token_ids[:12]]])
    engine.add_proposer(SuffixProposer("suffix", store, k_max=8, vocab_size=engine.vocab_size))
    engine.add_proposer(PromptLookup("lookup", ngram_max=3, ngram_min=1, k_max=8))
    engine.add_proposer(DraftModel(truncated_model(model, 2), "draft", k_max=4))
    return engine


def sampled(seed: int) -> SamplingSettings:
    return SamplingSettings(temperature=1.0, seed=seed)


PENALISED = SamplingSettings(
    temperature=1.0, seed=4, presence_penalty=-2.0, frequency_penalty=1.0, frequency_context_size=6
)
BESIDE_PENALISED = SamplingSettings(presence_penalty=1.5, repetition_penalty=1.3)

# What one row holds of its own: (the request, the requests it runs beside).
ROWS = {
    "suffix proposer": (
        (PROMPTS[0], GenerationSettings(max_tokens=30, k=4), "suffix"),
        [(p, GenerationSettings(max_tokens=40, k=3), "suffix") for p in PROMPTS[1:]],
    ),
    "seeded sampling": (
        (PROMPTS[0], GenerationSettings(max_tokens=30, k=3, sampling=sampled(5)), "lookup"),
        [
            (p, GenerationSettings(max_tokens=40, k=2, sampling=sampled(5 + i)), "lookup")
            for i, p in enumerate(PROMPTS[1:])
        ],
    ),
    "sampled drafts": (  # a draft model samples its drafts with the row's generator
        (PROMPTS[0], GenerationSettings(max_tokens=16, k=3, sampling=sampled(8)), "draft"),
        [
            (p, GenerationSettings(max_tokens=24, k=2, sampling=sampled(9 + i)), "draft")
            for i, p in enumerate(PROMPTS[1:3])
        ],
    ),
    "penalties": (  # its own penalties over its own tokens, beside rows with others
        (PROMPTS[0], GenerationSettings(max_tokens=30, k=3, sampling=PENALISED), "draft"),
        [
            (p, GenerationSettings(max_tokens=40, k=3, sampling=BESIDE_PENALISED), "lookup")
            for p in PROMPTS[1:]
        ],
    ),
    "stop strings": (  # its stop string: a piece of its answer (`with_stop`)
        (PROMPTS[0], GenerationSettings(max_tokens=40, k=3), "lookup"),
        [(p, GenerationSettings(max_tokens=40, k=3, stop=["zz"]), "lookup") for p in PROMPTS[1:]],
    ),
    "history off": (
        (PROMPTS[0], GenerationSettings(max_tokens=30, k=4, history=False), "suffix"),
        [(p, GenerationSettings(max_tokens=40, k=3), "suffix") for p in PROMPTS[1:]],
    ),
}


def run(engine: Engine, request: tuple, beside: list[tuple], join_at: int | None) -> Done:
    """`request` alone (`join_at` None) or joining a batch of `beside` after `join_at`
    rounds; its Done."""
    scheduler = Scheduler(engine, max_batch=4)
    scheduler.prefill_chunk = 4
    ids = [scheduler.submit(*args) for args in beside] if join_at is not None else []
    mine = scheduler.submit(*request) if join_at in (None, 0) else None
    events = []
    for number, out in enumerate(scheduler.drain()):
        events.extend(out.get(mine, []))
        if mine is None and number + 1 == join_at:
            assert scheduler.active, "the batch it joins is running"
            mine = scheduler.submit(*request)
    done = events[-1]
    assert isinstance(done, Done)
    if ids:
        assert any(done.record.batch_sizes[2:]), "it ran beside others"
    return done


def with_stop(engine: Engine, request: tuple) -> tuple:
    """`request` stopped at a piece of the middle of its own answer."""
    prompt, settings, proposer = request
    text = list(engine.stream(prompt, settings, proposer))[-1].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    return prompt, dataclasses.replace(settings, stop=[stop]), proposer


def outcome(done: Done) -> dict:
    record = done.record
    return {
        "tokens": list(done.token_ids),
        "text": done.text,
        "drafted": record.drafted,
        "accepted_lengths": list(record.accepted_lengths),
        "from_history": record.drafted_from_history,
        "from_request": record.drafted_from_request,
    }


@pytest.mark.parametrize("kind", list(ROWS))
def test_a_row_drafts_accepts_and_samples_as_it_would_alone(engine, kind):
    request, beside = ROWS[kind]
    if kind == "stop strings":
        request = with_stop(engine, request)
    alone = outcome(run(engine, request, beside, None))
    assert alone["drafted"] > 0
    if kind == "suffix proposer":
        assert alone["from_history"] > 0  # its drafts read the history
    if kind == "history off":
        assert alone["from_history"] == 0
    if kind == "stop strings":
        assert alone["text"] and request[1].stop[0] not in alone["text"]
        assert len(alone["tokens"]) < 40  # the stop string ended it
    for join_at in (0, 7):  # with them, and into their running batch
        assert outcome(run(engine, request, beside, join_at)) == alone, f"joined at {join_at}"


def test_seeded_rows_beside_each_other_sample_as_they_would_alone(engine):
    """The same prompt and proposer with two seeds, in one batch: each row's samples
    are its seed's alone (rows that shared one generator would draw each other's)."""
    twins = [
        (PROMPTS[1], GenerationSettings(max_tokens=30, k=2, sampling=sampled(s)), "lookup")
        for s in (1, 2)
    ]
    alone = [outcome(run(engine, twin, [], None)) for twin in twins]
    assert alone[0]["tokens"] != alone[1]["tokens"]  # the seed, not chance, sets the draws
    scheduler = Scheduler(engine, max_batch=2)
    ids = [scheduler.submit(*twin) for twin in twins]
    ends = {}
    for out in scheduler.drain():
        ends.update({i: e[-1] for i, e in out.items() if isinstance(e[-1], Done)})
    assert [outcome(ends[i]) for i in ids] == alone


def test_each_row_gets_its_own_proposer_state_and_policy(engine):
    """A named proposer is copied for each row (its caches and indexes its own, weights
    and history shared) and each row's policy starts afresh; the engine's own proposer
    and kept policies, which a request alone uses, are left as they were."""
    suffix = engine.proposers["suffix"]
    suffix._sync([1, 2, 3])  # state of the engine's own request, which no row may take
    mine = private_copy(suffix)
    assert mine is not suffix and mine.store is suffix.store  # the history is shared
    assert mine._indexed == 0 and mine._request is not suffix._request
    assert mine.drafted is not suffix.drafted
    mine.drafted["history"] += 5
    assert suffix.drafted["history"] == 0 and suffix._indexed == 3
    suffix.reset()
    scheduler = Scheduler(engine, max_batch=2)
    kept = dict(engine._policies)
    for prompt in PROMPTS[:2]:
        scheduler.submit(prompt, GenerationSettings(max_tokens=8), "suffix")
    first, second = scheduler.waiting
    assert first.proposer is not second.proposer and suffix not in (first.proposer, second.proposer)
    assert first.run.policy is not second.run.policy
    assert first.run.policy not in engine._policies.values()
    list(scheduler.drain())
    assert engine._policies == kept


class GreedyRun:
    """What `batch_greedy_reads` reads of a request: its sampling, scorer, grammar and
    whether it counts near ties."""

    def __init__(self, settings: SamplingSettings | None = None, counts: bool = True):
        self.sampling = settings or SamplingSettings()
        self.scorer = TokenScorer(self.sampling)
        self.counts_near_ties = counts
        self.constraint = None


def test_a_greedy_batch_reads_its_rows_in_one_go_as_each_row_alone():
    """One argmax and one near-tie test over the whole verify (on a GPU, a handful of
    kernels instead of eight a row): each row's reads equal `greedy_reads` of its own
    logits, near ties planted at known places included."""
    logits = mx.random.normal((3, 5, 40), key=mx.random.key(0)) * 4
    logits[0, 1, 7] = logits[0, 1].max() + 1e-5  # near ties: rows 0 and 2
    logits[2, 3, 9] = logits[2, 3].max() + 1e-5
    runs, lengths = [GreedyRun() for _ in range(3)], [5, 2, 4]
    whole = batch_greedy_reads(runs, logits)
    mx.eval(whole)
    together = split_reads(whole, lengths)
    for i, (run, n) in enumerate(zip(runs, lengths)):
        alone = greedy_reads(run, logits[i, :n])
        assert together[i] == {name: read.tolist() for name, read in alone.items()}
    assert [sum(r["near_ties"]) for r in together] == [1, 0, 1]
    penalised = SamplingSettings(repetition_penalty=1.2)  # processed logits: row by row
    assert batch_greedy_reads([*runs[:2], GreedyRun(penalised)], logits) is None
    assert (
        batch_greedy_reads([*runs[:2], GreedyRun(SamplingSettings(temperature=0.7))], logits)
        is None
    )
    constrained = GreedyRun()
    constrained.constraint = object()  # a grammar masks its rows: read row by row
    assert batch_greedy_reads([*runs[:2], constrained], logits) is None


def test_a_suffix_row_counts_as_drafts_only_what_the_batch_verified(engine):
    """Adaptive rows in a batch: the round's width cuts drafts, and what it cut was never
    drafted, so the record's drafts by origin add up to the drafts verified."""
    scheduler = Scheduler(engine, max_batch=4)
    ids = [scheduler.submit(p, GenerationSettings(max_tokens=40), "suffix") for p in PROMPTS]
    done = {}
    for out in scheduler.drain():
        done.update({i: events[-1] for i, events in out.items() if isinstance(events[-1], Done)})
    records = [done[i].record for i in ids]
    assert sum(r.drafted_from_history for r in records) > 0
    for record in records:
        assert record.drafted_from_request + record.drafted_from_history == record.drafted
