"""`serve --max-batch`: concurrent clients share target passes, each gets its solo answer.

A real uvicorn server (the `serving` helper of test_server) and the official `openai`
client, with the tiny llamas of test_server behind it.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import mlx.core as mx
import openai
import pytest
from test_server import (
    CHAT,
    ECHO,
    TinyProvider,
    TinyRuntime,
    direct_answer,
    serving,
    wait_until_idle,
)
from test_units import CPU_LIKE_COST
from tiny_models import VOCAB, byte_tokenizer, tiny_model

from mlxspec.decoding.engine import Engine, GenerationSettings
from mlxspec.drafter.head import HeadSpec, build_head
from mlxspec.events import Done
from mlxspec.proposers import PromptLookup
from mlxspec.proposers.head import HeadProposer
from mlxspec.server import ServerLimits, create_app
from mlxspec.server.background import serving_in_thread

BATCH = ServerLimits(max_batch=4, max_waiting=16)
PROMPTS = [f"{word} {word} {word} {ECHO}" for word in ("alpha", "beta", "gamma", "delta", "pi")]


@pytest.fixture(scope="module")
def app():
    return create_app(TinyProvider(), limits=BATCH)


@pytest.fixture(scope="module")
def base_url(app):
    with serving_in_thread(app) as url:
        yield url
    assert not app.state.worker.thread.is_alive(), "the worker outlived the server"


def ask(base_url: str, content: str, max_tokens: int = 40):
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="-", max_retries=0, timeout=60)
    return client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": content}],
        max_tokens=max_tokens,
        temperature=0,
    )


def ran_beside_others(response) -> bool:
    sizes = response.model_extra["x_mlxspec"]["batch_sizes"]
    return any(sizes[2:])


def test_concurrent_clients_share_rounds_and_get_their_solo_answers(base_url):
    solo = [direct_answer([{"role": "user", "content": p}], 40) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(lambda p: ask(base_url, p), PROMPTS))
    assert [a.choices[0].message.content for a in answers] == solo
    assert sum(map(ran_beside_others, answers)) >= 2  # the rounds really were shared
    health = httpx.get(f"{base_url}/health").json()
    assert health["active"] == 0 and health["waiting"] == 0
    assert health["tokens_per_second"] > 0  # the answers just relayed


def test_a_client_that_leaves_frees_its_slot_and_the_others_go_on(app, base_url, monkeypatch):
    """The row of a client that left is cancelled with its job: from then on no verify
    runs a row whose job is gone (counted pass by pass, not timed)."""
    from mlxspec.batch.caches import BatchCaches

    worker, passes = app.state.worker, []
    verify = BatchCaches.verify

    def counted(caches, rows):  # on the worker's thread, between its own steps
        rows_of = {slot.request_id for slot in worker._scheduler.active}
        passes.append((rows_of, set(worker._jobs)))
        return verify(caches, rows)

    monkeypatch.setattr(BatchCaches, "verify", counted)
    solo = direct_answer([{"role": "user", "content": PROMPTS[0]}], 40)
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="-", max_retries=0, timeout=60)
    with ThreadPoolExecutor(1) as pool:
        stream = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": ECHO}],
            max_tokens=3000,
            temperature=0,
            stream=True,
        )
        pieces = iter(stream)
        next(pieces)
        other = pool.submit(ask, base_url, PROMPTS[0])
        next(pieces)
        stream.close()
        assert other.result().choices[0].message.content == solo
    wait_until_idle(base_url)
    assert len(set().union(*(rows for rows, _ in passes))) == 2  # both rows ran
    assert all(rows <= jobs for rows, jobs in passes), "a row ran on after its client left"


def test_tree_requests_share_the_batch_and_get_their_solo_answers(base_url):
    """A request that asks for draft trees joins the batch (it once waited for the
    batch to drain, then ran alone) and answers as alone."""
    solo = [direct_answer([{"role": "user", "content": p}], 40) for p in PROMPTS[:3]]
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="-", max_retries=0, timeout=60)

    def ask_tree(content: str):
        return client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": content}],
            max_tokens=40,
            temperature=0,
            extra_body={"mlxspec": {"tree": True, "proposer": "draft", "k": 3}},
        )

    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(ask_tree, PROMPTS[:3]))
    assert [a.choices[0].message.content for a in answers] == solo
    records = [a.model_extra["x_mlxspec"] for a in answers]
    assert all(r["tree"] and r["tree_rounds"] > 0 for r in records)
    assert sum(map(ran_beside_others, answers)) >= 2


def test_a_bad_request_gets_a_4xx_and_disturbs_nobody(base_url):
    solo = direct_answer([{"role": "user", "content": PROMPTS[1]}], 40)
    too_long = {"messages": [{"role": "user", "content": "x" * 2000}], "max_tokens": 4}
    with ThreadPoolExecutor(2) as pool:
        good = pool.submit(ask, base_url, PROMPTS[1])
        bad = httpx.post(base_url + CHAT, json=too_long, timeout=30)
        assert good.result().choices[0].message.content == solo
    assert bad.status_code == 400 and "context" in bad.json()["error"]["message"]


class FamilyRuntime:
    """A tiny model of another family, prompt lookup its proposer."""

    family = "llama"

    def __init__(self):
        model = tiny_model(self.family, seed=2)
        self.engine = Engine(
            model, byte_tokenizer(), self.family, [PromptLookup()], verify_cost=CPU_LIKE_COST
        )

    def proposer(self, name: str | None) -> str:
        return "prompt-lookup" if name is None else name


class JambaRuntime(FamilyRuntime):
    family = "jamba"  # Mamba layers that would absorb a padded row's padding


class GemmaRuntime(FamilyRuntime):
    family = "gemma3_text"  # sliding-window layers (window 12 tokens)


class FamilyProvider(TinyProvider):
    def __init__(self, runtime: type[FamilyRuntime]):
        super().__init__()
        self.runtime = runtime

    def open(self, name: str) -> FamilyRuntime:
        self.opened.append(self.runtime())
        return self.opened[-1]


def served_and_alone(provider: TinyProvider, max_tokens: int, proposer: str | None = None):
    """Three concurrent clients' answers, each with what the engine says alone (its Done)."""
    with serving(provider, limits=BATCH) as url:
        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda p: ask(url, p, max_tokens=max_tokens), PROMPTS[:3]))
    engine, settings = provider.opened[-1].engine, GenerationSettings(max_tokens)
    alone = [
        list(engine.stream([{"role": "user", "content": p}], settings, proposer))[-1]
        for p in PROMPTS[:3]
    ]
    return list(zip(answers, alone))


def test_a_model_the_batch_cannot_hold_serves_one_request_at_a_time():
    for answer, done in served_and_alone(FamilyProvider(JambaRuntime), 12):
        assert answer.choices[0].message.content == done.text
        assert answer.model_extra["x_mlxspec"]["batch_sizes"] == []  # it ran alone


def test_a_sliding_window_model_shares_the_batch_and_answers_as_alone():
    """Gemma 3's local layers keep a window of the last tokens; in a batch they keep the
    whole history with the window as their mask, so such a model batches (it once
    served one request at a time) and every answer, longer than the window, is its own."""
    pairs = served_and_alone(FamilyProvider(GemmaRuntime), 40)
    for answer, done in pairs:
        assert answer.choices[0].message.content == done.text
    assert sum(ran_beside_others(answer) for answer, _ in pairs) >= 2


class HeadRuntime(TinyRuntime):
    """A tiny llama whose default proposer is a drafter head (untrained: it drafts from
    the target's hidden states alone, and nearly all its drafts are refused)."""

    def __init__(self, name: str):
        super().__init__(name)
        spec = HeadSpec(hidden_size=64, vocab_size=VOCAB, final_norm=True, feed_normed=True)
        mx.random.seed(0)
        head = build_head(spec, self.engine.target.model, mx.arange(VOCAB))
        self.engine.add_proposer(HeadProposer(head, self.engine.target, k_max=4))

    def proposer(self, name: str | None) -> str:
        return "head" if name is None else name


class HeadProvider(TinyProvider):
    def open(self, name: str) -> HeadRuntime:
        self.opened.append(HeadRuntime(name))
        return self.opened[-1]


def test_head_requests_share_the_batch_rather_than_waiting_to_run_alone():
    """A head reads the target's hidden states; the batch hands each row its own, so
    head requests join it (they once waited for it to drain) and answer as alone."""
    pairs = served_and_alone(HeadProvider(), 16, "head")
    for answer, done in pairs:
        assert isinstance(done, Done) and answer.choices[0].message.content == done.text
        assert answer.model_extra["x_mlxspec"]["proposer"] == "head"
    assert sum(ran_beside_others(answer) for answer, _ in pairs) >= 2


def test_64_clients_against_max_batch_8_none_lost_and_429_only_beyond_the_bound():
    """64 clients at once. With the defaults (8 generating, the queue bounded by the wait
    it would impose, not by a count) none is refused and every one gets its solo answer;
    with an explicit cap of 8 queued, only requests beyond the 16 the server can hold are
    refused, each with a 429 and Retry-After."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(64)]
    solo = {p: direct_answer([{"role": "user", "content": p}], 12) for p in PROMPTS}
    roomy = ServerLimits(max_batch=8)
    with serving(TinyProvider(), limits=roomy) as url:
        with ThreadPoolExecutor(64) as pool:
            answers = list(pool.map(lambda p: ask(url, p, max_tokens=12), prompts))
        assert [a.choices[0].message.content for a in answers] == [solo[p] for p in prompts]
        assert max(len(a.model_extra["x_mlxspec"]["batch_sizes"]) for a in answers) == 9
        wait_until_idle(url)

    def post(prompt: str) -> httpx.Response:
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 12}
        return httpx.post(url + CHAT, json={**body, "temperature": 0}, timeout=60)

    tight = ServerLimits(max_batch=8, max_waiting=8)
    with serving(TinyProvider(), limits=tight) as url:
        with ThreadPoolExecutor(64) as pool:
            replies = list(pool.map(post, prompts))
        served = [(p, r) for p, r in zip(prompts, replies) if r.status_code == 200]
        refused = [r for r in replies if r.status_code != 200]
        assert len(served) >= 16  # the batch and the queue were full before any 429
        assert all(r.status_code == 429 and r.headers.get("retry-after") for r in refused)
        for prompt, reply in served:
            assert reply.json()["choices"][0]["message"]["content"] == solo[prompt]
        wait_until_idle(url)


def test_a_batch_that_cannot_be_prepared_at_start_fails_requests_instead_of_hanging(
    monkeypatch,
):
    """Preparing the batch at start-up (measuring its pass costs) may fail, e.g. out of
    memory: the generation thread must live on, and each request fail alone with a 500."""
    import mlxspec.server.batch_worker as batch_worker

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory while measuring the pass grid")

    monkeypatch.setattr(batch_worker, "Scheduler", broken)
    with serving(TinyProvider(), limits=BATCH, preload="tiny") as url:
        reply = httpx.post(
            url + CHAT, json={"messages": [{"role": "user", "content": "hi"}]}, timeout=30
        )
        assert reply.status_code == 500 and reply.json()["error"]["type"] == "server_error"


def test_switching_models_lets_the_old_batch_go_before_the_next_model_loads():
    """One model in memory at a time, batched or not: the old engine (held by the batch's
    scheduler and its kept prefixes) is gone when the next model opens."""
    import gc
    import weakref

    class Watching(TinyProvider):
        def __init__(self):
            super().__init__()
            self.engines: list = []
            self.alive_at_open: list[bool] = []

        def open(self, name):
            gc.collect()
            self.alive_at_open += [ref() is not None for ref in self.engines]
            runtime = TinyRuntime(name)  # not kept in `opened`: only the server holds it
            self.engines.append(weakref.ref(runtime.engine))
            return runtime

    provider = Watching()
    with serving(provider, limits=BATCH) as url:
        for name in ("tiny", "tiny-b"):
            body = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            assert httpx.post(url + CHAT, json=body, timeout=60).status_code == 200
    assert provider.alive_at_open == [False]  # tiny's engine was gone when tiny-b opened


def test_kept_prefixes_hold_their_own_rows_not_the_whole_batch():
    """A finished row's kept cache is evaluated when kept: lazily, it would keep the
    whole batch's cache of that moment alive (every row, full size)."""
    import gc

    import mlx.core as mx
    from test_batch import collect, sample_prompts, scheduler_for

    scheduler = scheduler_for("llama", max_batch=8)
    for i, prompt in enumerate((sample_prompts(3) + sample_prompts(4))[:8]):
        scheduler.submit(prompt, GenerationSettings(max_tokens=20 + 7 * i), "lookup")
    collect(scheduler)
    del scheduler.target
    gc.collect()
    held = mx.get_active_memory()
    for kept in scheduler.prefixes.kept:
        mx.eval([c.keys for c in kept.cache] + [c.values for c in kept.cache])
    gc.collect()
    assert mx.get_active_memory() == held  # nothing was left to compute or let go


def test_the_queue_counts_free_slots_only_where_the_batch_can_take_them():
    """Free batch slots widen the queue (a burst waits for the round to end), but not
    for a model that cannot batch, nor while a request runs alone."""
    from mlxspec.server.batch_worker import BatchedWorker

    worker = BatchedWorker(FamilyProvider(JambaRuntime), max_waiting=2, max_batch=4)
    assert worker.queue_room == 6  # nothing loaded yet: the batch may take four
    worker._open("tiny")
    assert worker._scheduler_for(worker._model.engine) is None  # jamba cannot batch
    assert worker.queue_room == 2
    tiny = BatchedWorker(TinyProvider(), max_waiting=2, max_batch=4)
    tiny._open("tiny")
    tiny._scheduler_for(tiny._model.engine)
    assert tiny.queue_room == 6
    tiny._running = object()  # a request the batch could not take runs alone
    assert tiny.queue_room == 2


def test_serve_row_floor_reaches_the_batch(monkeypatch):
    """`serve --row-floor F` is the floor each round's width is chosen under: every
    width the server's batch chooses is chosen with F."""
    from mlxspec.batch import scheduler as scheduler_module

    limits = ServerLimits(max_batch=4, row_floor=0.25)
    app = create_app(TinyProvider(), limits=limits)
    floors = []

    def choose_width(estimates, floor, cost, row_floor):
        floors.append(row_floor)
        return 2

    monkeypatch.setattr(scheduler_module, "choose_width", choose_width)
    scheduler = app.state.worker._scheduler_for(TinyRuntime("tiny").engine)
    scheduler.pass_cost.wants_plain = lambda rows: False
    for prompt in PROMPTS[:2]:
        scheduler.submit(prompt, GenerationSettings(max_tokens=6), "prompt-lookup")
    list(scheduler.drain())
    assert floors and set(floors) == {0.25}


def test_clients_that_leave_at_any_point_leave_nothing_behind_in_the_batch():
    """48 clients against 8 slots, a third of them leaving: before their first byte (a
    client timeout), mid-stream after a few chunks, or at once after sending. Afterwards the
    batch's own bookkeeping holds no row, no job and no KV beyond its kept prefixes, every
    client that stayed got its solo answer, and the server still answers."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(48)]
    solo = {p: direct_answer([{"role": "user", "content": p}], 24) for p in PROMPTS}
    app = create_app(TinyProvider(), limits=ServerLimits(max_batch=8))

    def client(index: int, url: str) -> str | None:
        body = {"messages": [{"role": "user", "content": prompts[index]}], "max_tokens": 24}
        leaving = index % 3 == 0
        if not leaving:
            reply = httpx.post(url + CHAT, json=body, timeout=120)
            return reply.json()["choices"][0]["message"]["content"]
        way = index // 3 % 3
        if way == 0:  # gives up before its first byte
            with pytest.raises(httpx.TimeoutException):
                httpx.post(url + CHAT, json=body, timeout=0.05)
        elif way == 1:  # reads a few chunks of its stream, then closes the connection
            with httpx.stream("POST", url + CHAT, json={**body, "stream": True}, timeout=120) as r:
                for _, _line in zip(range(3), r.iter_lines()):
                    pass
        else:  # sends and goes at once
            with httpx.Client(timeout=120) as leaver:
                with leaver.stream("POST", url + CHAT, json=body):
                    pass
        return None

    with serving_in_thread(app) as url:
        with ThreadPoolExecutor(48) as pool:
            answers = list(pool.map(lambda i: client(i, url), range(48)))
        for index, answer in enumerate(answers):
            if index % 3:
                assert answer == solo[prompts[index]]
        wait_until_idle(url, seconds=30)
        worker = app.state.worker
        scheduler = worker._scheduler
        assert worker._jobs == {} and worker._rows() == 0 and worker.waiting == 0
        assert not scheduler.active and not scheduler.joining and not scheduler.waiting
        kept = sum(layer.nbytes for k in scheduler.prefixes.kept for layer in k.cache)
        assert scheduler.kv_reserved() == kept  # what the kept prefixes hold, nothing more
        assert len(scheduler.prefixes.kept) <= scheduler.prefixes.capacity
        again = ask(url, PROMPTS[0], max_tokens=24).choices[0].message.content
        assert again == solo[PROMPTS[0]]
