"""Suffix decoding: the prefix index, the history store on disk, the proposer, lossless."""

from __future__ import annotations

import errno
import hashlib
import random
import subprocess
import sys
import textwrap
import warnings
from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from lossless import assert_follows_law, assert_lossless, plain_greedy
from test_lossless import CPU_LIKE_COST, FAMILIES
from test_units import ReadCounting
from tiny_models import VOCAB, byte_tokenizer, tiny_model

from mlxspec.decoding.engine import Engine, GenerationSettings
from mlxspec.events import Done
from mlxspec.proposers.base import ProposalContext
from mlxspec.proposers.suffix import SuffixProposer
from mlxspec.registry.models_toml import load_registry
from mlxspec.sampling import SamplingSettings
from mlxspec.suffix.index import MAX_MATCH, SENTINEL, PrefixIndex
from mlxspec.suffix.store import HistoryStore, HistoryWarning

ROOT = Path(__file__).resolve().parents[1]


def brute_longest(index: PrefixIndex, context: list[int]) -> tuple[int, int]:
    """(longest match, how many places it ends at), by trying every position."""
    best, count = 0, 0
    for position in range(len(index.tokens)):
        length = 0
        while (
            length < min(len(context), MAX_MATCH)
            and position - length >= 0
            and index.tokens[position - length] == context[-1 - length]
        ):
            length += 1
        if length > best:
            best, count = length, 1
        elif length == best and length:
            count += 1
    return best, count


@pytest.mark.parametrize("seed", range(20))
def test_index_stays_sorted_and_finds_the_longest_match(seed):
    rng = random.Random(seed)
    index = PrefixIndex()
    # Few distinct ids (long matches), spread over a real vocabulary's range.
    alphabet = [rng.randrange(50_000) for _ in range(4)]
    for _ in range(rng.randint(1, 6)):
        index.add_document([rng.choice(alphabet) for _ in range(rng.randint(1, 60))])
    keys = [index.key(int(p)) for p in index.order]
    assert keys == sorted(keys)
    rebuilt = PrefixIndex(index.tokens)  # the bulk sort agrees with insertion
    assert [rebuilt.key(int(p)) for p in rebuilt.order] == keys
    context = [rng.choice(alphabet) for _ in range(10)]
    length, lo, hi = index.longest_match(context)
    assert (length, hi - lo) == brute_longest(index, context)
    index.drop_oldest(len(index.tokens) // 2)
    assert index.tokens[0] == SENTINEL
    keys = [index.key(int(p)) for p in index.order]
    assert keys == sorted(keys) and len(keys) == np.count_nonzero(index.tokens != SENTINEL)


def context_for(tokens: list[int], history: bool = True) -> ProposalContext:
    return ProposalContext(tokens, None, None, None, None, history)


def test_request_index_built_whole_or_round_by_round_agrees():
    """The request's index is built in bulk at a new prompt, then grows each round."""
    rng = random.Random(5)
    phrase = [rng.randrange(49_000) for _ in range(12)]
    tokens = [rng.randrange(49_000) for _ in range(40)] + phrase + [7, 8] + phrase
    growing = SuffixProposer()
    for end in range(45, len(tokens)):
        ctx = context_for(tokens[:end], history=False)
        found, fresh = growing.situation(ctx), SuffixProposer().situation(ctx)
        assert (found and found.key) == (fresh and fresh.key)
    assert found.key == "request>=8"


class CountingOrder(np.ndarray):
    """A prefix index's order that counts the entries read out of it (any indexing)."""

    read = 0

    def __getitem__(self, index):
        got = super().__getitem__(index)
        CountingOrder.read += np.size(got)
        return got


def test_a_round_reads_a_bounded_part_of_a_long_request():
    """At 20k tokens of context, a round reads a few hundred context tokens and index
    entries (the new tokens, the ends compared, binary searches, a capped sample of a
    common match's 1,000 occurrences), and appends without copying the stream."""
    rng = random.Random(3)
    tokens = [rng.randrange(2_000) for _ in range(20_000)]
    for start in range(0, len(tokens), 20):
        tokens[start : start + 2] = [7, 8]  # a common short match, as code's indents are
    proposer = SuffixProposer(store=None)
    proposer.situation(context_for(ReadCounting(tokens), history=False))
    room, moves = None, 0
    for step in range(40):
        tokens += [5_000 + step, 7, 8] if step % 2 else [3]  # 7, 8: a 2-token match
        index = proposer._request
        index.order = index.order.view(CountingOrder)
        ReadCounting.read = CountingOrder.read = 0
        ctx = context_for(ReadCounting(tokens), history=False)
        situation = proposer.situation(ctx)
        if step % 2:  # ends in the common match: its latest occurrence drafts
            assert situation.key == "request>=2"
            assert proposer.propose(ctx, 3).tokens  # the stream goes on
        assert proposer._request is index  # grown, not rebuilt
        assert ReadCounting.read < 1_000 and CountingOrder.read < 1_000
        moves, room = moves + (index._room is not room), index._room
    assert moves <= 2  # the stream grew into spare room, not a copy a round
    edited = [*tokens[:-1], 9]  # another conversation of the same length: indexed anew
    found = proposer.situation(context_for(edited, history=False))
    fresh = SuffixProposer(store=None).situation(context_for(edited, history=False))
    assert proposer._request is not index and (found and found.key) == (fresh and fresh.key)


def test_periodic_text_drafts_past_one_period():
    """ "Beta Beta Beta": the latest match leaves one period; copying with overlap goes on."""
    beta = [66, 101, 116, 97, 32]
    proposer = SuffixProposer(store=None)
    tokens = beta * 4
    situation = proposer.situation(context_for(tokens))
    assert situation is not None and situation.key.startswith("request")
    assert proposer.propose(context_for(tokens), 12).tokens == (beta * 3)[:12]


def test_history_continuation_scored_by_frequency(tmp_path):
    """Three earlier requests went on "x", one "y": the tree keeps both, x scored 3/4."""
    store = HistoryStore(tmp_path)
    for follower in (7, 7, 7, 9):
        store.add([1, 2, 3, 4, follower, 8])
    proposer = SuffixProposer(store=store)
    ctx = context_for([5, 2, 3, 4])
    situation = proposer.situation(ctx)
    assert situation.key == "history>=3"
    tree = proposer.propose_tree(ctx, 2, 8)
    first = {tree.tokens[i]: tree.scores[i] for i, p in enumerate(tree.parents) if p == 0}
    assert first == {7: 0.75, 9: 0.25}
    assert proposer.propose(ctx, 2).tokens == [7, 8]
    assert proposer.situation(context_for([5, 2, 3, 4], history=False)) is None


def test_store_persists_across_processes(tmp_path):
    script = textwrap.dedent(
        f"""
        from mlxspec.suffix.store import HistoryStore
        HistoryStore({str(tmp_path)!r}).add([10, 11, 12, 13, 14])
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=ROOT)
    index = HistoryStore(tmp_path).index
    assert index.longest_match([99, 11, 12])[0] == 2
    assert (tmp_path / "index.bin").exists() and not (tmp_path / "journal.bin").exists()


def test_size_bound_drops_the_oldest(tmp_path):
    bound = 4096
    store = HistoryStore(tmp_path, bound_bytes=bound)
    for n in range(40):
        store.add([n] * 50)
    store = HistoryStore(tmp_path, bound_bytes=bound)
    tokens = store.index.tokens.tolist()
    assert (tmp_path / "index.bin").stat().st_size <= bound
    assert 39 in tokens and 0 not in tokens


@pytest.mark.parametrize("damage", ["truncate", "garbage", "journal"])
def test_damaged_store_is_rebuilt_with_one_warning(tmp_path, damage):
    HistoryStore(tmp_path).add([1, 2, 3, 4])
    len(HistoryStore(tmp_path).index)  # writes index.bin
    path = tmp_path / "index.bin"
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:-3])
    elif damage == "garbage":
        path.write_bytes(bytes(range(256)) * 4)
    else:
        (tmp_path / "journal.bin").write_bytes(b"SFXJ\x05\x00\x00\x00garbage")
    with pytest.warns(HistoryWarning) as caught:
        index = HistoryStore(tmp_path).index
    assert len(caught) == 1
    assert len(index) == (4 if damage == "journal" else 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(HistoryStore(tmp_path).index) == len(index)  # repaired on disk


def test_two_writers_at_once_leave_a_valid_store(tmp_path):
    script = textwrap.dedent(
        f"""
        import sys
        from mlxspec.suffix.store import HistoryStore
        base = int(sys.argv[1])
        for n in range(60):
            store = HistoryStore({str(tmp_path)!r})
            store.add([base + n] * 20)
            if n % 3 == 0:
                len(store.index)  # a reader merging the journal while the other appends
        """
    )
    writers = [
        subprocess.Popen([sys.executable, "-c", script, str(base)], cwd=ROOT) for base in (0, 100)
    ]
    assert all(writer.wait(timeout=120) == 0 for writer in writers)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no damage to report
        index = HistoryStore(tmp_path).index
    keys = [index.key(int(p)) for p in index.order]
    assert keys == sorted(keys)
    assert index.documents == 120  # none lost to a merge racing an append


def history_engine(family: str, seed: int, store: HistoryStore) -> tuple:
    tokenizer = byte_tokenizer()
    model = tiny_model(family, seed=seed)
    engine = Engine(model, tokenizer, family, verify_cost=CPU_LIKE_COST, history=store)
    engine.add_proposer(SuffixProposer("suffix", store, k_max=8, vocab_size=engine.vocab_size))
    return model, tokenizer, engine


@pytest.mark.parametrize("family", FAMILIES)
def test_suffix_is_lossless_with_helpful_and_misleading_history(family, tmp_path):
    store = HistoryStore(tmp_path)
    model, tokenizer, engine = history_engine(family, 0, store)
    eos = set(tokenizer.eos_token_ids)
    rng = random.Random(family)
    prompts = [[rng.randrange(256) for _ in range(12)] for _ in range(2)]
    for prompt in prompts:
        reference = plain_greedy(model, prompt, 40, eos)
        store.add([*prompt, *reference])  # helpful: what the model really says next
        misleading = [(t + 1) % 256 for t in reference]
        store.add([*prompt, *misleading])  # and twice a wrong version of it
        store.add([*prompt, *reference[:5], *misleading[5:]])
        for tree in (False, True):
            for k in (None, 4):
                settings = GenerationSettings(max_tokens=40, k=k, tree=tree)
                done = list(engine.stream(prompt, settings, "suffix"))[-1]
                label = f"{family} tree={tree} k={k}"
                assert_lossless(model, prompt, reference, list(done.token_ids), label)
                assert done.record.drafted_from_history > 0, label


@pytest.mark.parametrize("tree", [False, True], ids=["line", "tree"])
def test_sampled_drafts_from_history_keep_the_target_distribution(tree, tmp_path):
    """Sampling with drafts from history: a request's first token, whatever the history
    drafted (a line of its likeliest continuation, or a tree of those its cost pays for),
    follows the target's own law (chi-square over seeded requests, 8 to a batch)."""
    from mlxspec.batch.scheduler import Scheduler

    store = HistoryStore(tmp_path)
    model, _, engine = history_engine("llama", 1, store)
    prompt, temperature, runs = list(range(40, 52)), 3.0, 200
    law = np.array(mx.softmax(model(mx.array([prompt]))[0, -1] / temperature).tolist())
    for rank, token in enumerate(np.argsort(law)[::-1][:3].tolist()):
        for _ in range(3 - rank):  # the likeliest continuation the most often seen
            store.add([*prompt, token])
    scheduler = Scheduler(engine, max_batch=8)
    for seed in range(runs):
        sampling = SamplingSettings(temperature=temperature, seed=seed)
        settings = GenerationSettings(max_tokens=3, k=2, tree=tree, sampling=sampling)
        scheduler.submit(prompt, settings, "suffix")
    first, from_history, nodes = Counter(), 0, 0
    for out in scheduler.drain():
        for events in out.values():
            if isinstance(done := events[-1], Done):
                first[done.token_ids[0] if done.token_ids else VOCAB - 1] += 1
                from_history += done.record.drafted_from_history
                nodes += done.record.tree_nodes
    # Most requests' first token was drafted from history and verified (a batch's width
    # may cut a tree's draft: then it was never verified, and does not count).
    assert from_history >= runs // 2
    assert (nodes > 0) == tree  # some trees held several of the history's continuations
    assert_follows_law(first, law, f"tree={tree}")


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_no_history_leaves_the_store_byte_identical(tmp_path):
    store = HistoryStore(tmp_path)
    store.add([1, 2, 3, 4, 5, 6])  # a journal not merged yet: a read would merge it
    before = digest(tmp_path)
    _, _, engine = history_engine("llama", 0, HistoryStore(tmp_path))
    settings = GenerationSettings(max_tokens=10, history=False)
    done = list(engine.stream([1, 2, 3, 4], settings, "suffix"))[-1]
    assert digest(tmp_path) == before and done.record.history_tokens == 0
    list(engine.stream([1, 2, 3, 4], GenerationSettings(max_tokens=10), "suffix"))
    assert digest(tmp_path) != before  # with history on, the same run reads and writes it


def test_every_entry_offers_suffix():
    registry = load_registry()
    assert all(entry.proposer("suffix").kind == "suffix" for entry in registry.entries.values())
    # --model with a hub id or a path too: the agent suite's default methods need it.
    named = registry.including("someone/some-model").get("someone/some-model")
    assert named.proposer("suffix").kind == "suffix"


def test_history_can_be_turned_off_per_model(tmp_path):
    from mlxspec.registry.models_toml import RegistryError, parse_registry_text

    text = '[models.m]\ntarget = "smollm2-135m"\n[models.m.defaults]\nhistory = {}\n'
    entries, _ = parse_registry_text(text.format("false"), tmp_path / "models.toml")
    assert entries["m"].defaults.history is False
    with pytest.raises(RegistryError, match="history"):
        parse_registry_text(text.format("0"), tmp_path / "models.toml")


def test_a_long_journal_is_folded_into_the_index(tmp_path, monkeypatch):
    """A server that keeps its index loaded still keeps the journal short (and picks up
    what another process appended meanwhile)."""
    import mlxspec.suffix.store as store_module

    monkeypatch.setattr(store_module, "JOURNAL_BYTES", 1000)
    store = HistoryStore(tmp_path)
    len(store.index)
    HistoryStore(tmp_path).add([77] * 10)  # another process's request
    for n in range(10):
        store.add([n] * 30)
    assert (tmp_path / "journal.bin").stat().st_size <= 1000 + 30 * 4 + 12
    assert 77 in store.index.tokens.tolist() and 9 in store.index.tokens.tolist()


def generate(engine, prompt, settings, proposer: str, batched: bool) -> Done:
    """One request through the single loop, or through the batch (serve --max-batch)."""
    from mlxspec.batch.scheduler import Scheduler

    if batched:
        scheduler = Scheduler(engine, max_batch=2)
        request_id = scheduler.submit(prompt, settings, proposer)
        return [out[request_id][-1] for out in scheduler.drain() if request_id in out][-1]
    return list(engine.stream(prompt, settings, proposer))[-1]


def stored_documents(folder: Path) -> list[list[int]]:
    """What a store in `folder` holds, read back as another process would: its
    documents, oldest first."""
    stream = HistoryStore(folder).index.tokens.tolist()
    documents, current = [], []
    for token in stream[1:]:
        if token == SENTINEL:
            documents.append(current)
            current = []
        else:
            current.append(token)
    return documents


@pytest.mark.parametrize("batched", [False, True])
def test_the_history_keeps_each_prompt_and_every_token_said_in_order(batched, tmp_path):
    """A finished request is stored whole: its prompt, then each generated token (the
    last one too), in order; one stopped by a stop string, up to what it said; one with
    history off, not at all."""
    model, tokenizer, engine = history_engine("llama", 0, HistoryStore(tmp_path))
    prompts = [list(range(40, 52)), [7, 8, 9, 7, 8, 9, 7]]
    said = []
    for prompt, tokens in zip(prompts, (17, 9)):
        done = generate(engine, prompt, GenerationSettings(max_tokens=tokens), "suffix", batched)
        assert len(done.token_ids) == tokens
        said.append([*prompt, *done.token_ids])
    generate(engine, [3, 4, 5], GenerationSettings(max_tokens=5, history=False), "none", batched)
    assert stored_documents(tmp_path) == said


def test_two_models_in_one_data_dir_never_see_each_others_history():
    """Each model's history is its own (a store shared by models would draft one model's
    answers for another, and show one user's requests to another model's users)."""
    from mlxspec.suffix.store import history_store, store_dir

    names = ["org/model-1", "org/model-2"]
    assert store_dir(names[0]) != store_dir(names[1])
    tokenizer = byte_tokenizer()
    engines = []
    for name in names:
        store = history_store(name)
        assert history_store(name) is store  # one store object per model in a process
        engine = Engine(tiny_model("llama", seed=0), tokenizer, name, history=store)
        engine.add_proposer(SuffixProposer("suffix", store, k_max=8, vocab_size=257))
        engines.append(engine)
    prompt = list(range(40, 52))
    first = list(engines[0].stream(prompt, GenerationSettings(max_tokens=20), "suffix"))[-1]
    assert stored_documents(store_dir(names[0])) == [[*prompt, *first.token_ids]]
    assert stored_documents(store_dir(names[1])) == []
    again = list(engines[0].stream(prompt, GenerationSettings(max_tokens=20), "suffix"))[-1]
    other = list(engines[1].stream(prompt, GenerationSettings(max_tokens=20), "suffix"))[-1]
    assert again.record.drafted_from_history > 0  # its own history drafts for it
    assert other.record.drafted_from_history == 0  # the other model's does not
    assert other.record.history_tokens == 0


@pytest.mark.parametrize("batched", [False, True])
def test_history_hits_are_counted_in_either_loop(batched, tmp_path):
    """`mlxspec history`'s hit rate counts the drafts from history the target kept, in the
    single loop and in the batch (serve --max-batch) alike."""
    store = HistoryStore(tmp_path)
    model, tokenizer, engine = history_engine("llama", 0, store)
    prompt = list(range(40, 52))
    reference = plain_greedy(model, prompt, 30, set(tokenizer.eos_token_ids))
    # Helpful: what the model really says next, and longer than any draft of the answer.
    store.add([*prompt, *reference, *reference])  # longer than any draft of the answer
    # A fixed k: a batch's width never cuts a draft, so every draft counted is verified.
    settings = GenerationSettings(max_tokens=30, k=4)
    done = generate(engine, prompt, settings, "suffix", batched)
    assert list(done.token_ids) == reference
    # Every draft from this history was the answer itself, so the target kept each one.
    drafted = done.record.drafted_from_history
    assert drafted > 0 and store.stats() == {"drafted": drafted, "accepted": drafted}
    generate(engine, prompt, settings, "suffix", batched)
    assert store.stats() == {"drafted": 2 * drafted, "accepted": 2 * drafted}  # totals add up
    wrong = HistoryStore(tmp_path / "wrong")  # each token of it differs from the answer's
    wrong.add([*prompt, *[(t + 1) % 256 for t in reference]])
    _, _, engine = history_engine("llama", 0, wrong)
    done = generate(engine, prompt, settings, "suffix", batched)
    drafted = done.record.drafted_from_history
    assert drafted > 0 and wrong.stats() == {"drafted": drafted, "accepted": 0}


def test_suffix_in_a_chain_reports_its_draft_origins(tmp_path):
    """A models.toml chain may list suffix: its record and history stats still count."""
    from mlxspec.proposers import Chain, PromptLookup

    store = HistoryStore(tmp_path)
    model, tokenizer, engine = history_engine("llama", 0, store)
    suffix = SuffixProposer("suffix", store, k_max=8, vocab_size=engine.vocab_size)
    engine.add_proposer(Chain([suffix, PromptLookup("prompt-lookup")], name="both"))
    prompt = list(range(40, 52))
    store.add([*prompt, *plain_greedy(model, prompt, 30, set(tokenizer.eos_token_ids))])
    done = list(engine.stream(prompt, GenerationSettings(max_tokens=30), "both"))[-1]
    assert done.record.drafted_from_history > 0
    assert store.stats()["drafted"] == done.record.drafted_from_history


def test_a_history_that_cannot_be_written_costs_speed_not_the_answer(tmp_path):
    """History is on by default; a data dir that cannot be written (read-only home, a
    file in the way) warns once and every request still completes."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    store = HistoryStore(blocker / "suffix")
    _, _, engine = history_engine("llama", 0, store)
    with pytest.warns(HistoryWarning) as warned:
        for proposer in ("none", "suffix", "suffix"):
            done = list(engine.stream([1, 2, 3, 4], GenerationSettings(max_tokens=6), proposer))
            assert isinstance(done[-1], Done) and len(done[-1].token_ids) == 6
    assert len(warned) == 1, [str(w.message) for w in warned]


def test_an_answer_copying_its_prompt_drafts_the_latest_passage_in_full():
    """Where a copied phrase starts, the answer matches its prompt by two tokens only (its
    own words before differ); prompt lookup still drafts the whole latest passage, and so
    must suffix: not two tokens (the history's depth cap) nor the continuation two older
    passages share (a majority that is not the one being copied)."""
    older, latest = list(range(100, 112)), list(range(200, 212))
    prompt = [1, 5, 6, *older, 2, 5, 6, *older, 3, 5, 6, *latest, 4]
    ctx = context_for([*prompt, 9, 5, 6])
    proposer = SuffixProposer(store=None)
    assert proposer.situation(ctx).key == "request>=2"
    assert proposer.propose(ctx, 8).tokens == latest[:8]
    tree = proposer.propose_tree(ctx, 8, 8)  # room for one 8-token line only
    node = 0
    for token in latest[:8]:  # it is the latest passage's
        children = [i + 1 for i, parent in enumerate(tree.parents) if parent == node]
        node = next((i for i in children if tree.tokens[i - 1] == token), None)
        assert node is not None, (token, tree.tokens)


def seeded_engine(store: HistoryStore, seed: PrefixIndex) -> tuple[Engine, SuffixProposer]:
    tokenizer = byte_tokenizer()
    engine = Engine(
        tiny_model("llama"), tokenizer, "llama", verify_cost=CPU_LIKE_COST, history=store
    )
    proposer = SuffixProposer("suffix", store, 8, vocab_size=engine.vocab_size, seed=lambda: seed)
    engine.add_proposer(proposer)
    return engine, proposer


def test_the_seed_drafts_with_history_on_and_is_never_written_to_the_users_store(tmp_path):
    prompt = list(range(40, 52))
    plain = Engine(tiny_model("llama"), byte_tokenizer(), "llama", verify_cost=CPU_LIKE_COST)
    answer = list(list(plain.stream(prompt, GenerationSettings(max_tokens=30), None))[-1].token_ids)
    seed = PrefixIndex(np.asarray([SENTINEL, *prompt, *answer, SENTINEL], np.int32))
    store = HistoryStore(tmp_path / "history")
    store.add([1, 2, 3])
    before = digest(tmp_path / "history")
    engine, _ = seeded_engine(store, seed)
    off = list(engine.stream(prompt, GenerationSettings(max_tokens=30, history=False), "suffix"))
    assert off[-1].record.drafted_from_history == 0 and digest(tmp_path / "history") == before
    on = list(engine.stream(prompt, GenerationSettings(max_tokens=30), "suffix"))[-1]
    assert on.record.drafted_from_history > 0 and list(on.token_ids) == answer
    kept = HistoryStore(tmp_path / "history").index
    assert kept.documents == 2  # the user's request and this one: nothing of the seed


@pytest.mark.slow
def test_the_shipped_seed_matches_the_real_tokenizer(smollm2):
    from mlxspec.drafter.answers import read_answers, tokenizer_hash
    from mlxspec.suffix.seed import seed_index

    index = seed_index("smollm2-135m", smollm2.tokenizer)
    answers = read_answers("smollm2-135m")
    assert index is not None and index.documents == len(answers)
    assert tokenizer_hash(smollm2.tokenizer) == answers.manifest["tokenizer_sha256"]
    text = smollm2.tokenizer.decode(answers.answer_ids[0])
    assert text.strip() and "\ufffd" not in text


def test_the_seed_is_off_unless_an_entry_turns_it_on(tmp_path):
    """Measured not faster on the chat suite (docs/suffix.md), so opt-in."""
    from mlxspec.registry.models_toml import parse_registry_text

    text = '[models.m]\ntarget = "smollm2-135m"\n[models.m.proposers.seeded]\nkind = "suffix"\n'
    entries, _ = parse_registry_text(text + "seed = true\n", tmp_path / "models.toml")
    assert entries["m"].proposer("suffix").options["seed"] is False
    assert entries["m"].proposer("seeded").options["seed"] is True


class FullDisk:
    """The store module's `open` for writing, on a disk with `room` bytes left: a write
    past it stores what fits, then raises ENOSPC, as a real full disk does."""

    def __init__(self, room: int = 0):
        self.room = room

    def open(self, path, mode="r", *args, **kwargs):
        real = open(path, mode, *args, **kwargs)
        if "r" in mode:
            return real
        disk = self

        class Filling:
            def __getattr__(self, name):
                return getattr(real, name)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                real.close()

            def write(self, data):
                fits = min(len(data), disk.room)
                real.write(data[:fits])
                disk.room -= fits
                if fits < len(data):
                    real.flush()
                    raise OSError(errno.ENOSPC, "No space left on device")
                return fits

        return Filling()


def store_files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.name != "lock"}


def test_a_full_disk_leaves_the_journal_whole_and_warns_once(tmp_path, monkeypatch):
    import mlxspec.suffix.store as store_module

    HistoryStore(tmp_path).add([1, 2, 3, 4])
    before = store_files(tmp_path)
    monkeypatch.setattr(store_module, "open", FullDisk(room=10).open, raising=False)
    store = HistoryStore(tmp_path)
    with pytest.warns(HistoryWarning) as warned:
        store.add([5, 6, 7, 8])  # half a record fits
        store.add([9, 9, 9])
    assert len(warned) == 1, [str(w.message) for w in warned]
    assert store_files(tmp_path) == before  # no half record left to read as damage
    monkeypatch.undo()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tokens = HistoryStore(tmp_path).index.tokens.tolist()  # read back with no warning
    assert {1, 2, 3, 4} <= set(tokens) and not {5, 9} & set(tokens)


def test_a_full_disk_while_merging_keeps_the_old_index_and_serves_from_memory(
    tmp_path, monkeypatch
):
    import mlxspec.suffix.store as store_module

    store = HistoryStore(tmp_path)
    store.add([1, 2, 3, 4])
    len(store.index)  # index.bin written
    HistoryStore(tmp_path).add([5, 6, 7])  # in the journal
    before = store_files(tmp_path)
    monkeypatch.setattr(store_module, "JOURNAL_BYTES", 0)  # every add merges
    monkeypatch.setattr(store_module, "open", FullDisk(room=0).open, raising=False)
    store = HistoryStore(tmp_path)
    with pytest.warns(HistoryWarning) as warned:
        len(store.index)  # a merge that cannot be written back
        store.add([8, 8, 8])  # the journal cannot take it either, nor a merge after
    assert len(warned) == 1, [str(w.message) for w in warned]
    assert store_files(tmp_path) == before  # no temporary left, no file cut
    assert 8 in store.index.tokens.tolist() and 5 in store.index.tokens.tolist()


def test_a_full_disk_costs_the_requests_nothing(tmp_path, monkeypatch):
    import mlxspec.suffix.store as store_module

    store = HistoryStore(tmp_path)
    _, _, engine = history_engine("llama", 0, store)
    monkeypatch.setattr(store_module, "JOURNAL_BYTES", 0)
    monkeypatch.setattr(store_module, "open", FullDisk(room=100).open, raising=False)
    with pytest.warns(HistoryWarning) as warned:
        for proposer in ("none", "suffix", "suffix"):
            done = list(engine.stream([1, 2, 3, 4], GenerationSettings(max_tokens=6), proposer))
            assert isinstance(done[-1], Done) and len(done[-1].token_ids) == 6
    assert len(warned) == 1, [str(w.message) for w in warned]
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
