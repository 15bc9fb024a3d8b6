"""The prompt cache: an agent's next turn reuses what earlier requests prefilled, for
every cache kind (plain KV, sliding windows, recurrent and hybrid layers), across a
side request, in the batch, from disk after a restart, and never past its bytes. Every
answer stays plain greedy's, token for token."""

from __future__ import annotations

import json
import logging
import random

import mlx.core as mx
import pytest
from lossless import assert_lossless, plain_greedy
from mlx_lm.models.cache import ArraysCache, KVCache
from test_lossless import CPU_LIKE_COST
from tiny_models import byte_tokenizer, tiny_model

from mlxspec.batch import caches as batch_caches
from mlxspec.batch.scheduler import Scheduler
from mlxspec.decoding.engine import Engine, GenerationSettings
from mlxspec.events import Done
from mlxspec.models import prompt_disk
from mlxspec.models import target as target_module
from mlxspec.models.prompt_cache import PromptCache
from mlxspec.models.prompt_disk import DiskCache
from mlxspec.proposers.lookup import PromptLookup

# Plain KV; sliding windows (a ring that wraps at 12 tokens alone, full histories in a
# batch); conv state beside attention; Gated DeltaNet beside attention (Qwen3.5).
KINDS = ["llama", "gemma3_text", "lfm2", "qwen3_5"]
ANSWER = 12


def words(rng: random.Random, n: int) -> list[int]:
    """Byte tokens that repeat now and then (prompt lookup finds something to draft)."""
    pool = [[rng.randrange(97, 123) for _ in range(rng.randint(2, 6))] for _ in range(30)]
    out: list[int] = []
    while len(out) < n:
        out += rng.choice(pool) + [32]
    return out[:n]


def engine_for(family: str, pool: PromptCache | None = None, seed: int = 3) -> Engine:
    engine = Engine(
        tiny_model(family, seed=seed),
        byte_tokenizer(),
        family,
        verify_cost=CPU_LIKE_COST,
        prompt_cache=pool,
    )
    engine.add_proposer(PromptLookup("lookup", ngram_max=3, ngram_min=1, k_max=6))
    return engine


def answer(engine: Engine, prompt: list[int], label: str) -> Done:
    """The engine's greedy answer, checked against plain greedy decoding."""
    done = [e for e in engine.stream(prompt, GenerationSettings(max_tokens=ANSWER), "lookup")]
    done = done[-1]
    assert isinstance(done, Done)
    model = engine.target.model
    reference = plain_greedy(model, prompt, ANSWER, set(engine.tokenizer.eos_token_ids))
    assert_lossless(model, prompt, reference, list(done.token_ids), label, done.record)
    return done


def agent_session(seed: int = 0) -> tuple[list[int], list[int], list[int], list[int]]:
    """(turn 1, turn 2: turn 1 + its answer re-worded + a tool result, a side request
    under another system prompt, turn 3: turn 2 + the next tool result)."""
    rng = random.Random(seed)
    system = words(rng, 300)
    turn1 = system + words(rng, 40)
    turn2 = turn1 + words(rng, 10) + words(rng, 60)
    side = words(rng, 120)
    turn3 = turn2 + words(rng, 10) + words(rng, 50)
    return turn1, turn2, side, turn3


@pytest.mark.parametrize("family", KINDS)
def test_every_cache_kind_reuses_the_next_turn_and_survives_a_side_request(family):
    """Issue 61's table, now: the next turn reuses its whole previous prompt (its
    answer, re-worded, is not reused, as the template re-renders it), and so does the
    turn after a side request, which once evicted the conversation (and with recurrent or
    window layers nothing was ever reused)."""
    engine = engine_for(family)
    turn1, turn2, side, turn3 = agent_session()
    assert answer(engine, turn1, "turn 1").record.reused_prompt_tokens == 0
    # The cache holds all but a prompt's last token (fed with the first verify); a KV
    # history also gives what the answer's first words share with their re-wording.
    first = answer(engine, turn2, "turn 2").record.reused_prompt_tokens
    assert len(turn1) - 1 <= first < len(turn2) - 1, (first, len(turn1))
    assert answer(engine, side, "side").record.reused_prompt_tokens == 0
    again = answer(engine, turn3, "turn 3").record.reused_prompt_tokens
    assert len(turn2) - 1 <= again < len(turn3) - 1, (again, len(turn2))
    if engine.target.snapshot_layers:  # a checkpoint: exactly the last prompt
        assert (first, again) == (len(turn1) - 1, len(turn2) - 1)


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_a_prompt_that_extends_the_answer_reuses_the_answer_too(family):
    """A chat whose next prompt is exactly what was generated plus the new message: KV
    and recurrent state alike reuse the answer (the entry left at the request's end)."""
    engine = engine_for(family)
    turn1, _, side, _ = agent_session(1)
    first = answer(engine, turn1, "turn 1")
    answer(engine, side, "side")  # the conversation's cache goes to the pool meanwhile
    follow = turn1 + list(first.token_ids) + words(random.Random(2), 30)
    reused = answer(engine, follow, "follow-up").record.reused_prompt_tokens
    assert reused == len(turn1) + len(first.token_ids) - 1


@pytest.mark.parametrize("family", ["gemma3_text", "qwen3_5"])
def test_checkpoints_inside_a_long_prompt_serve_a_prompt_that_diverges_there(family, monkeypatch):
    """A cache that cannot be cut back serves a prompt diverging inside a long prefill
    from the last checkpoint before the divergence (every CHECKPOINT_EVERY tokens)."""
    monkeypatch.setattr(target_module, "CHECKPOINT_EVERY", 64)
    monkeypatch.setattr(target_module, "PREFILL_CHUNK", 32)
    engine = engine_for(family)
    rng = random.Random(4)
    long = words(rng, 300)
    answer(engine, long, "long")
    diverged = long[:200] + words(rng, 20)
    assert answer(engine, diverged, "diverged").record.reused_prompt_tokens == 192


@pytest.mark.parametrize("family", ["llama", "lfm2", "qwen3_5", "gemma3_text"])
def test_a_batch_reuses_the_engines_pool_across_interleaved_requests(family, monkeypatch):
    """Rows of a batch take the engine's pool (shared with its requests alone): the
    main conversation's next turn reuses its prompt while side requests ran beside it;
    with recurrent layers, from the checkpoint its prefill left at the prompt's end."""
    monkeypatch.setattr(batch_caches, "CHECKPOINT_EVERY", 64)
    engine = engine_for(family)
    scheduler = Scheduler(engine, max_batch=4)
    scheduler.prefill_chunk = 48
    assert scheduler.prefixes is engine.prompt_cache
    turn1, turn2, side, turn3 = agent_session(5)
    settings = GenerationSettings(max_tokens=ANSWER)
    reused: dict[str, int] = {}
    for round_ in ([("turn1", turn1), ("side", side)], [("turn2", turn2), ("side2", side)]):
        ids = {scheduler.submit(p, settings, "lookup"): (name, p) for name, p in round_}
        done: dict[int, Done] = {}
        for out in scheduler.drain():
            for request_id, events in out.items():
                ended = [e for e in events if isinstance(e, Done)]
                if ended:
                    done[request_id] = ended[-1]
        for request_id, (name, prompt) in ids.items():
            model = engine.target.model
            eos = set(engine.tokenizer.eos_token_ids)
            reference = plain_greedy(model, prompt, ANSWER, eos)
            got = list(done[request_id].token_ids)
            assert_lossless(model, prompt, reference, got, name, done[request_id].record)
            reused[name] = done[request_id].record.reused_prompt_tokens
    assert reused["turn1"] == reused["side"] == 0
    assert len(turn1) - 1 <= reused["turn2"] < len(turn2) - 1
    assert reused["side2"] >= len(side) - 1
    if scheduler.target.recurrent:
        assert (reused["turn2"], reused["side2"]) == (len(turn1) - 1, len(side) - 1)
        # Checkpoints inside turn 2's prompt, for a later divergence: one at the end of
        # the first chunk past each CHECKPOINT_EVERY tokens.
        marks = [0] + sorted(
            len(k.tokens) for k in engine.prompt_cache.kept if turn2[: len(k.tokens)] == k.tokens
        )
        assert max(b - a for a, b in zip(marks, marks[1:])) <= 64 + 48, marks


def kv_entry(n: int) -> list[KVCache]:
    layer = KVCache()
    layer.update_and_fetch(mx.ones((1, 2, n, 8)), mx.ones((1, 2, n, 8)))
    return [layer]


def test_the_pool_keeps_within_its_bytes_least_recently_used_out_first():
    """Entries go oldest first once the pool passes its bytes; one taken since is kept;
    a spilled entry reaches the disk."""
    a, b, c, d = ([i] * 20 for i in range(1, 5))
    each = kv_entry(20)[0].nbytes
    pool = PromptCache(max_bytes=int(3.5 * each))
    for tokens in (a, b, c):
        pool.add(tokens, kv_entry(20))
    assert pool.nbytes == 3 * each
    cache, reused = pool.take(a + [9], ("KVCache",))
    assert reused == 20 and cache[0].offset == 20
    pool.add(d, kv_entry(20))
    assert [k.tokens for k in pool.kept] == [c, a, d]  # b, the least recently used, went
    assert pool.nbytes <= pool.max_bytes
    pool.evict_to(0)
    assert not pool.kept


def test_a_longer_kv_entry_supersedes_its_prefixes_and_a_checkpoint_does_not():
    pool = PromptCache()
    pool.add([1] * 20, kv_entry(20))
    pool.add([1] * 30, kv_entry(30))
    assert [len(k.tokens) for k in pool.kept] == [30]  # any prefix of it is served by it
    state = ArraysCache(1)
    state[0] = mx.zeros((1, 4))
    pool.add([2] * 20, [state])
    longer = ArraysCache(1)
    longer[0] = mx.ones((1, 4))
    pool.add([2] * 30, [longer])
    assert sorted(len(k.tokens) for k in pool.kept if k.form == ("ArraysCache",)) == [20, 30]
    # A checkpoint serves only a prompt that extends it whole.
    assert pool.reusable([2] * 25 + [3], ("ArraysCache",)) == 20
    assert pool.reusable([2] * 19 + [3], ("ArraysCache",)) == 0
    assert pool.reusable([1] * 25 + [3], ("KVCache",)) == 25


@pytest.mark.parametrize("family", KINDS)
def test_a_restart_starts_from_the_disk_and_answers_the_same(family, tmp_path):
    """The caches written as a process ends serve the next process (another engine on
    the same weights), with the same answer; another weight form's folder is never
    read."""
    turn1, turn2, _, _ = agent_session(7)
    first = engine_for(family, PromptCache(disk=DiskCache(tmp_path, "model|bf16", 1 << 30)))
    answer(first, turn1, "before the restart")
    first.save_prompts()
    files = list(tmp_path.rglob("*.safetensors"))
    assert files and all(not f.name.startswith(".") for f in files)
    again = engine_for(family, PromptCache(disk=DiskCache(tmp_path, "model|bf16", 1 << 30)))
    reused = answer(again, turn2, "after the restart").record.reused_prompt_tokens
    assert len(turn1) - 1 <= reused < len(turn2) - 1
    other = engine_for(family, PromptCache(disk=DiskCache(tmp_path, "model|q4", 1 << 30)))
    assert answer(other, turn2, "other weights").record.reused_prompt_tokens == 0


def test_a_corrupt_file_is_skipped_with_a_warning(tmp_path, caplog):
    turn1, turn2, _, _ = agent_session(8)
    first = engine_for("llama", PromptCache(disk=DiskCache(tmp_path, "k", 1 << 30)))
    answer(first, turn1, "before")
    first.save_prompts()
    (path,) = tmp_path.rglob("*.safetensors")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # torn: the header survives, the tensors not
    with caplog.at_level(logging.WARNING, "mlxspec.prompt_cache"):
        again = engine_for("llama", PromptCache(disk=DiskCache(tmp_path, "k", 1 << 30)))
        assert answer(again, turn2, "after").record.reused_prompt_tokens == 0
    assert any("skipping" in r.message for r in caplog.records)
    assert not path.exists()  # not read again


def test_a_full_disk_costs_one_warning_and_nothing_else(tmp_path, caplog, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(prompt_disk, "save_prompt_cache", full)
    rng = random.Random(9)
    engine = engine_for("llama", PromptCache(disk=DiskCache(tmp_path, "k", 1 << 30)))
    with caplog.at_level(logging.WARNING, "mlxspec.prompt_cache"):
        for _ in range(3):
            answer(engine, words(rng, 300), "full disk")
            engine.save_prompts()
    warned = [r for r in caplog.records if "No space left" in r.message]
    assert len(warned) == 1
    assert not list(tmp_path.rglob("*.safetensors*"))


def test_the_disk_keeps_within_its_bytes(tmp_path):
    disk = DiskCache(tmp_path, "k", 1 << 30)
    engine = engine_for("llama", PromptCache(disk=disk))
    rng = random.Random(10)
    for _ in range(3):
        answer(engine, words(rng, 300), "a prompt")
        engine.save_prompts()
    sizes = sorted(e.nbytes for e in disk.entries.values())
    assert len(sizes) == 3
    disk.max_bytes = sizes[0] + sizes[1]
    answer(engine, words(rng, 300), "one more")
    engine.save_prompts()
    assert disk.nbytes <= disk.max_bytes
    on_disk = sum(f.stat().st_size for f in tmp_path.rglob("*.safetensors"))
    assert on_disk == disk.nbytes


def test_a_kept_entry_is_a_copy_later_writes_cannot_reach():
    """The pool hands out copies: a request that writes on into what it took (and the
    target's cache writing on after a checkpoint) leaves each entry as it was."""
    engine = engine_for("qwen3_5")
    turn1, turn2, _, _ = agent_session(11)
    answer(engine, turn1, "turn 1")

    def arrays(kept):
        return [a for layer in kept.cache for a in layer.state if isinstance(a, mx.array)]

    before = {id(k): (k, [mx.array(a) for a in arrays(k)]) for k in engine.prompt_cache.kept}
    assert before
    answer(engine, turn2, "turn 2")
    answer(engine, turn2 + [32, 97], "turn 2 again")
    for kept, copies in before.values():
        for now, then in zip(arrays(kept), copies):
            assert mx.array_equal(now, then).item()


def test_generate_run_twice_starts_warm_and_the_cache_command_lists_and_clears(tmp_path):
    """`generate` writes its prompt's cache as it ends; the next run on the same prompt
    starts from it (same answer); `mlxspec cache` lists the folder's files and clears
    them; --no-prompt-cache-dir writes nothing."""
    from click.testing import CliRunner
    from test_loading import save_tiny_llama

    from mlxspec.cli import main

    folder = tmp_path / "tiny"
    save_tiny_llama(folder)
    cache = tmp_path / "prompts"
    prompt = " ".join(f"word{i % 37}" for i in range(120))  # ~600 byte tokens
    args = ["generate", prompt, "-m", str(folder), "-n", "8", "-p", "none", "--raw", "--json"]
    runs = []
    for _ in range(2):
        result = CliRunner().invoke(main, [*args, "--prompt-cache-dir", str(cache)])
        assert result.exit_code == 0, result.output
        runs.append(json.loads(result.stdout.splitlines()[-1]))
    assert runs[0]["record"]["reused_prompt_tokens"] == 0
    assert runs[1]["record"]["reused_prompt_tokens"] >= 500
    assert runs[1]["token_ids"] == runs[0]["token_ids"]
    env = {"MLXSPEC_PROMPT_CACHE_DIR": str(cache)}
    listed = CliRunner().invoke(main, ["cache", "list", "--json"], env=env)
    (model,) = json.loads(listed.stdout)["models"]
    assert model["files"] >= 1 and model["longest_prompt_tokens"] >= 500
    assert str(folder) in model["model"]
    cleared = CliRunner().invoke(main, ["cache", "clear", "--yes"], env=env)
    assert cleared.exit_code == 0 and not list(cache.rglob("*.safetensors"))
    off = CliRunner().invoke(main, [*args, "--no-prompt-cache-dir"], env=env)
    assert off.exit_code == 0 and not list(cache.rglob("*.safetensors"))


def test_a_long_prefill_says_how_far_it_is():
    """A prompt of at least LONG_PREFILL new tokens reports its prefill as it goes (the
    chat's status line, generate's stderr); a short one, and the reused part, do not."""
    from mlxspec.batch.single import LONG_PREFILL
    from mlxspec.events import ProgressNote

    notes: list[str] = []
    engine = engine_for("llama")
    engine.notify = notes.append
    prompt = words(random.Random(12), LONG_PREFILL + 100)
    answer(engine, prompt, "long")
    progress = [n for n in notes if isinstance(n, ProgressNote)]
    assert [(n.done, n.total) for n in progress][0] == (0, len(prompt) - 1)
    assert progress[-1].done == progress[-1].total == len(prompt) - 1
    assert len(progress) >= 4 and "new tokens" in progress[-1]
    notes.clear()
    answer(engine, prompt + words(random.Random(13), 50), "next turn")
    assert not [n for n in notes if isinstance(n, ProgressNote)]


def test_a_batch_row_past_its_window_leaves_its_prompt_kept():
    """A sliding-window row that ran past its window has had its oldest columns cut and
    cannot hand its sequence on when it leaves; its prompt was kept as it joined, whole
    (a plain history, cut to any prefix), so the next turn still reuses it."""
    from mlxspec.batch.target import WINDOW_SLACK

    engine = engine_for("gemma3_text")  # a window of 12 tokens
    scheduler = Scheduler(engine, max_batch=2)
    rng = random.Random(14)
    turn1 = words(rng, 12 + 2 * WINDOW_SLACK + 200)  # past what a row keeps of its window
    turn2 = turn1 + words(rng, 40)
    settings = GenerationSettings(max_tokens=ANSWER)
    for prompt, least in ((turn1, 0), (turn2, len(turn1) - 1)):
        request_id = scheduler.submit(prompt, settings, "lookup")
        done = [e for out in scheduler.drain() for e in out.get(request_id, [])][-1]
        model, eos = engine.target.model, set(engine.tokenizer.eos_token_ids)
        reference = plain_greedy(model, prompt, ANSWER, eos)
        assert_lossless(model, prompt, reference, list(done.token_ids), "window", done.record)
        assert done.record.reused_prompt_tokens >= least
    assert not scheduler.target.whole  # every row left
