"""Drafter heads in a batch: each row gets exactly the hidden states a request alone gets.

A head drafts from the target's hidden states of the tokens its row's cache took in
since the last round (`SingleCaches` hands them to a request alone). In the batch,
rows are left-padded, verified right-padded and trimmed to ragged lengths; a joining
request's prompt is prefilled over several rounds; one pass captures the union of the
rows' layers. Whatever the batch did, a row's states must be its own, with none of its
positions missed or handed over twice, and its output its plain greedy output.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import mlx.core as mx
import pytest
from lossless import assert_lossless, plain_greedy
from test_batch import collect
from test_block import block_proposer, dflash_checkpoint
from test_lossless import Oracle
from test_mtp import target as hybrid_target
from test_one_loop import EOS, engine_with, repeating_prompt
from tiny_models import VOCAB, tiny_model

from mlxspec.batch.caches import BatchCaches
from mlxspec.batch.rows import private_copy
from mlxspec.batch.scheduler import Scheduler
from mlxspec.batch.target import RECURRENT_CAPTURE, capture_unsupported
from mlxspec.bench.concurrency import batchable
from mlxspec.decoding.engine import Engine, GenerationError, GenerationSettings
from mlxspec.distributed.batch import PlannedCaches
from mlxspec.drafter.head import HeadSpec, build_head
from mlxspec.drafter.medusa import MedusaHeads
from mlxspec.events import Done
from mlxspec.models.target import Target
from mlxspec.proposers import ProposalContext, SelfSpeculation
from mlxspec.proposers.head import HeadProposer
from mlxspec.proposers.medusa import MedusaProposer

MAX_TOKENS = 20


def fed_hidden(model, tokens: list[int], capture: tuple[int, ...]) -> mx.array:
    """The hidden states (len(tokens), F) one fresh single-sequence fill computes."""
    return Target(model).fill(tokens, capture=capture)[1]


@pytest.mark.parametrize("family", ["llama", "qwen3_next"])
def test_batch_caches_keep_each_row_the_hidden_states_of_the_tokens_it_kept(family):
    """Rows with different captures (and one with none), prefilled in chunks, then
    ragged verifies and keeps: after each, a row holds the states of exactly the tokens
    it kept, in its own capture's columns (qwen3_next: also where rows that refused a
    draft were replayed from their copied recurrent state); a kept prefix is never
    reused for a row that captures (the pool keeps no hidden states), and still is for
    one that does not: the left row's whole sequence, or with recurrent layers (whose
    state has no prefix to cut) the checkpoint its prefill left at its prompt's end."""
    model = tiny_model("llama", seed=3) if family == "llama" else hybrid_target(family)
    caches = BatchCaches(model, prefix_capacity=2)
    prompts = [repeating_prompt(1), repeating_prompt(2)[:19], repeating_prompt(3)[:9]]
    captures = [(), (1,), None]
    for request_id, (prompt, capture) in enumerate(zip(prompts, captures)):
        caches.start(request_id, prompt, capture)
        while not caches.advance([request_id], 8):
            pass
        caches.join([request_id])
    assert caches.hidden[2] is None
    for row in (0, 1):
        expected = fed_hidden(model, prompts[row], captures[row])
        assert mx.allclose(caches.hidden[row], expected, atol=1e-4).item(), f"row {row}"
    sequences = [list(p) for p in prompts]
    rng = random.Random(0)
    for _ in range(5):
        rows = [[rng.randrange(1, 256) for _ in range(rng.randint(1, 4))] for _ in sequences]
        caches.verify(rows)
        n_keep = [rng.randint(1, len(row)) for row in rows]
        caches.keep(n_keep, max(map(len, rows)))
        for row, (tokens, kept) in enumerate(zip(rows, n_keep)):
            sequences[row] += tokens[:kept]
        assert caches.lengths() == [len(s) for s in sequences]
        assert caches.hidden[2] is None
        for row in (0, 1):
            expected = fed_hidden(model, sequences[row], captures[row])[-n_keep[row] :]
            assert caches.hidden[row].shape == expected.shape, f"row {row}"
            assert mx.allclose(caches.hidden[row], expected, atol=1e-4).item(), f"row {row}"
    caches.leave([1, 2], [(0, sequences[0])])
    if not caches.prefixes.capacity:
        return
    follow_up = [*sequences[0], 7, 8]
    assert caches.start(10, follow_up, ()) == 0
    caches.advance([10], len(follow_up))
    caches.join([10])
    assert mx.allclose(caches.hidden[-1], fed_hidden(model, follow_up, ()), atol=1e-4).item()
    checkpoint = len(follow_up) if caches.target.recurrent else len(sequences[0])
    assert caches.start(11, follow_up, None) == checkpoint  # the pool still serves


class SpyHead(HeadProposer):
    """A head that records (tokens, hidden) as each round's context hands them over.
    With an `oracle`, the head drafts as ever, then its tokens are replaced by the
    oracle's (the untrained head's are nearly all refused): rows accept raggedly."""

    def __init__(self, *args, oracle: Oracle | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.oracle = oracle
        self.seen: list[tuple[list[int], mx.array | None]] = []

    def propose(self, ctx, k):
        draft = super().propose(ctx, k)
        return self.oracle.propose(ctx, k) if self.oracle else draft

    def situation(self, ctx):
        self.seen.append((list(ctx.tokens), ctx.hidden))
        return super().situation(ctx)

    def observe(self, ctx):
        self.seen.append((list(ctx.tokens), ctx.hidden))
        super().observe(ctx)


class LayerReader:
    """A proposer that reads one layer's incoming residual stream besides the final
    state (as EAGLE-3 reads three layers) and never drafts: beside rows that read other
    layers, the batch must capture the union and hand each row its own columns."""

    name, k_max, needs_hidden, cost_hint = "layer-reader", 4, True, 0.0

    def __init__(self, layer: int = 1):
        self.target_layers = (layer,)
        self.seen: list[tuple[list[int], mx.array | None]] = []

    def situation(self, ctx):
        self.seen.append((list(ctx.tokens), ctx.hidden))
        return None

    def observe(self, ctx):
        self.seen.append((list(ctx.tokens), ctx.hidden))

    def propose(self, ctx, k):
        raise AssertionError("it never drafts")


@pytest.fixture(scope="module")
def batch_run():
    """A head and a layer reader in a batch of 3, two heads joining late (one waits
    for a slot): the prompts prefill over several rounds, ragged acceptance each round."""
    model = tiny_model("llama", seed=3)
    spec = HeadSpec(hidden_size=64, vocab_size=VOCAB, final_norm=True, feed_normed=True, layers=1)
    mx.random.seed(0)
    head = build_head(spec, model, mx.arange(VOCAB))
    engine = engine_with(model)
    scheduler = Scheduler(engine, max_batch=3)
    scheduler.prefill_chunk = 16
    prompts = [repeating_prompt(seed) for seed in (11, 12, 13, 14)]
    oracles = [Oracle(len(p), plain_greedy(model, p, MAX_TOKENS, EOS), k_max=4) for p in prompts]
    proposers = [SpyHead(head, engine.target, k_max=4, oracle=oracles[i]) for i in (0, 2)]
    proposers.insert(1, LayerReader())
    proposers.append(SpyHead(head, engine.target, k_max=4))  # its own drafts only
    settings = GenerationSettings(max_tokens=MAX_TOKENS, k=3)
    first = [scheduler.submit(prompts[i], settings, proposers[i]) for i in (0, 1)]
    late = [(prompts[i], settings, proposers[i]) for i in (2, 3)]
    events = collect(scheduler, late)
    assert sorted(events) == [*first, 2, 3]
    dones = [events[i][-1] for i in range(4)]
    assert all(isinstance(done, Done) for done in dones)
    return model, prompts, proposers, dones


def test_heads_in_a_batch_draft_and_equal_their_plain_greedy_output(batch_run):
    model, prompts, _, dones = batch_run
    for i, (prompt, done) in enumerate(zip(prompts, dones)):
        reference = plain_greedy(model, prompt, MAX_TOKENS, EOS)
        assert_lossless(model, prompt, reference, list(done.token_ids), f"row {i}", done.record)
        assert len(done.record.batch_sizes) > 2, f"row {i} never ran beside another"
    heads = [done.record for i, done in enumerate(dones) if i != 1]
    assert all(record.drafted > 0 for record in heads)  # the heads drafted in the batch
    assert all(0 < record.accepted < record.drafted for record in heads[:2])  # raggedly


def test_every_row_gets_the_hidden_states_of_exactly_the_tokens_its_round_added(batch_run):
    """Each row's hidden states, round by round and in the final `observe`, are those one
    fresh single-sequence pass computes for those positions: none missed, none twice."""
    model, prompts, proposers, dones = batch_run
    for i, (prompt, proposer, done) in enumerate(zip(prompts, proposers, dones)):
        assert_seen_all_its_own(model, prompt, proposer, done, f"row {i}")


def assert_seen_all_its_own(model, prompt: list[int], proposer, done: Done, label: str) -> None:
    """`proposer.seen` holds, round after round, the hidden states of every position of
    the request once, as one fresh single-sequence fill computes them."""
    last_tokens = proposer.seen[-1][0]
    produced = [*prompt, *done.token_ids]
    assert last_tokens[: len(produced)] == produced  # the last is `observe`'s
    _, states = Target(model).fill(last_tokens[:-1], capture=proposer.target_layers)
    covered = 0
    for tokens, hidden in proposer.seen:
        start = len(tokens) - 1 - hidden.shape[0]
        assert start == covered, f"{label}: positions {covered}..{start} missed or twice"
        expected = states[start : len(tokens) - 1]
        assert hidden.shape == expected.shape, label
        assert mx.allclose(hidden, expected, atol=1e-4).item(), f"{label} at {start}"
        covered = len(tokens) - 1
    assert covered == len(last_tokens) - 1


def test_a_batch_of_a_recurrent_family_refuses_heads_in_one_line():
    """LFM2's conv layers are not masked by `Decoder` as the model masks them: a head
    there runs alone (serve holds it until the batch drains), with the reason.
    GatedDeltaNet layers are (qwen3_next batches heads)."""
    model = tiny_model("lfm2", seed=3)
    assert capture_unsupported(model) == RECURRENT_CAPTURE
    assert capture_unsupported(tiny_model("llama")) is None
    assert capture_unsupported(hybrid_target("qwen3_next")) is None
    scheduler = Scheduler(engine_with(model), max_batch=2)
    with pytest.raises(GenerationError, match="reads the target's hidden states") as err:
        scheduler.submit([1, 2, 3], GenerationSettings(), LayerReader())
    assert "\n" not in str(err.value) and RECURRENT_CAPTURE in str(err.value)
    assert not scheduler.busy


def test_a_sharded_batch_refuses_heads_in_one_line():
    """Splitting the model for a capturing pass probes it with a forward of its own,
    which on a sharded target is a collective outside the ranks' plans: rank 0's batch
    refuses heads (serve runs them alone, sharded), and no call reaches the ranks."""
    engine = engine_with(tiny_model("llama", seed=3))
    caches = PlannedCaches(engine.target.model, 2, collectives=None)
    scheduler = Scheduler(engine, max_batch=2, caches=caches)
    with pytest.raises(GenerationError, match="sharded batch") as err:
        scheduler.submit([1, 2, 3], GenerationSettings(), LayerReader())
    assert "\n" not in str(err.value) and not caches.pending


@dataclass
class BenchRuntime:
    """What the concurrency bench asks of a runtime when it picks its rows."""

    engine: Engine

    def proposer(self, name: str) -> str:
        return name


def test_the_concurrency_bench_runs_head_rows_where_the_batch_can_capture():
    """`bench --concurrency` skips a proposer only where serve would run it alone: a
    head on an attention model batches now; self-speculation, or any hidden-state
    reader on a model with recurrent layers, still does not."""
    llama = engine_with(tiny_model("llama", seed=3), LayerReader())
    llama.add_proposer(SelfSpeculation(llama.target, layers=1, name="self-spec"))
    kept, refused = batchable(BenchRuntime(llama), ["layer-reader", "self-spec"])
    assert kept == ["layer-reader"] and list(refused) == ["self-spec"]
    lfm2 = BenchRuntime(engine_with(tiny_model("lfm2", seed=3), LayerReader()))
    kept, refused = batchable(lfm2, ["layer-reader"])
    assert kept == [] and RECURRENT_CAPTURE in refused["layer-reader"]


def test_medusa_rows_share_the_heads_and_equal_their_plain_greedy_output():
    """Medusa reads the last hidden state of each round: in a batch, each request's
    private copy starts afresh and shares the heads' weights (no copy per request)."""
    model = tiny_model("llama", seed=3)
    engine = engine_with(model)
    mx.random.seed(0)
    medusa = MedusaProposer(MedusaHeads(64, 3, mx.arange(VOCAB)), engine.target)
    engine.add_proposer(medusa)
    medusa._last, medusa._length = mx.zeros((1, 64)), 9  # the engine's own request's row
    mine = private_copy(medusa)
    assert mine is not medusa and mine.heads is medusa.heads  # its own state, shared weights
    assert mine._last is None and mine._length == 0
    mine.observe(ProposalContext([1, 2], None, None, None, mx.ones((2, 64))))
    assert medusa._length == 9 and mx.array_equal(medusa._last, mx.zeros((1, 64)))
    medusa.reset()
    scheduler = Scheduler(engine, max_batch=2)
    prompts = [repeating_prompt(seed) for seed in (21, 22)]
    settings = GenerationSettings(max_tokens=MAX_TOKENS, k=2)
    ids = [scheduler.submit(prompt, settings, "medusa") for prompt in prompts]
    events = collect(scheduler)
    for request_id, prompt in zip(ids, prompts):
        done = events[request_id][-1]
        reference = plain_greedy(model, prompt, MAX_TOKENS, EOS)
        assert_lossless(model, prompt, reference, list(done.token_ids), "medusa", done.record)
        assert done.record.drafted > 0 and len(done.record.batch_sizes) > 2


def test_block_drafter_rows_beside_a_layer_reader_equal_their_plain_greedy_output(tmp_path):
    """A block drafter reads several layers' outputs (the last one's too): batched with
    a row that reads another layer, the pass captures both and each row drafts from
    its own columns; every answer is its plain greedy one."""
    model = tiny_model("qwen3", seed=2)
    engine = engine_with(model)
    dflash_checkpoint(tmp_path)
    engine.add_proposer(block_proposer(engine, tmp_path, k_max=3))
    scheduler = Scheduler(engine, max_batch=3)
    prompts = [repeating_prompt(seed) for seed in (31, 32, 33)]
    settings = GenerationSettings(max_tokens=MAX_TOKENS, k=3)
    reader = LayerReader(layer=2)  # the block drafter reads 1 and 3
    ids = [scheduler.submit(prompts[0], settings, reader)]
    ids += [scheduler.submit(prompt, settings, "block") for prompt in prompts[1:]]
    events = collect(scheduler)
    for request_id, prompt in zip(ids, prompts):
        done = events[request_id][-1]
        reference = plain_greedy(model, prompt, MAX_TOKENS, EOS)
        assert_lossless(model, prompt, reference, list(done.token_ids), "block", done.record)
        assert len(done.record.batch_sizes) > 3  # beside both others
    assert all(events[i][-1].record.drafted > 0 for i in ids[1:])
    assert_seen_all_its_own(model, prompts[0], reader, events[ids[0]][-1], "reader")
