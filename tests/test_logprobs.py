"""Logprobs of emitted tokens: read from the target's own verify rows, they must be the
numbers plain decoding's one-token steps give at each position, whatever drafted the
tokens (prompt lookup, a draft model, a tree), alone or in a batch, greedy or sampled;
and nothing is computed for a request that did not ask."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import mlx.core as mx
import openai
import pytest
from lossless import plain_greedy
from mlx_lm.models.cache import make_prompt_cache
from test_distributed import SERVE_PROMPTS
from test_lossless import CPU_LIKE_COST, Oracle
from test_server import CHAT, HELLO, TEXT, TinyProvider, serving
from test_server import tiny_engine as server_engine
from tiny_models import VOCAB, byte_tokenizer, tiny_model

from mlxspec.batch.scheduler import Scheduler
from mlxspec.decoding import request
from mlxspec.decoding.engine import Engine, GenerationError, GenerationSettings
from mlxspec.events import OUTPUT_EVENTS, Done
from mlxspec.models.loading import load_model
from mlxspec.proposers import DraftModel, PromptLookup, truncated_model
from mlxspec.sampling import SamplingSettings
from mlxspec.server import ServerLimits

TOLERANCE = 1e-4  # float32: a verify pass and one-token steps round differently (~1e-5)
ECHO = "one two one two one two"  # the tiny llama answers it at length, with drafts
TOP = 5


def tiny_engine(seed: int = 1) -> Engine:
    """Seed 1: its first two layers, as a draft model, agree with it often."""
    model = tiny_model("llama", seed=seed)
    draft = DraftModel(truncated_model(model, 2), name="draft", k_max=4)
    return Engine(
        model, byte_tokenizer(), "tiny", [PromptLookup(), draft], verify_cost=CPU_LIKE_COST
    )


def plain_logprobs(model, prompt: list[int], tokens: list[int]) -> list[mx.array]:
    """Plain decoding's log-softmax rows (V,) before each of `tokens`: the prompt in one
    pass, then one token a step."""
    cache = make_prompt_cache(model)
    logits = model(mx.array(prompt)[None], cache=cache)[0, -1]
    rows = []
    for token in tokens:
        logits = logits.astype(mx.float32)
        rows.append(logits - mx.logsumexp(logits))
        logits = model(mx.array([[token]]), cache=cache)[0, -1]
    return rows


def assert_plain_logprobs(model, prompt: list[int], done: Done, top: int, what: str) -> None:
    """Each emitted token's logprob and alternatives are plain decoding's at its position."""
    entries = done.logprobs
    assert entries is not None and [e.token for e in entries] == list(done.token_ids), what
    for position, (entry, row) in enumerate(
        zip(entries, plain_logprobs(model, prompt, done.token_ids))
    ):
        where = f"{what}: token {position}"
        assert abs(entry.logprob - row[entry.token].item()) < TOLERANCE, where
        assert len(entry.top) == top, where
        best = mx.sort(row)[::-1][:top].tolist()
        assert [a.logprob for a in entry.top] == pytest.approx(best, abs=TOLERANCE), where
        for alternative in entry.top:
            assert abs(alternative.logprob - row[alternative.token].item()) < TOLERANCE, where


def run(engine: Engine, prompt, settings: GenerationSettings, proposer: str | None) -> list:
    return list(engine.stream(prompt, settings, proposer))


def check_events(events: list, done: Done) -> None:
    """The events' logprobs, in order, are the Done's: one per token of each event, each
    token's offset where its text starts in the answer."""
    outputs = [e for e in events if isinstance(e, OUTPUT_EVENTS)]
    for event in outputs:
        assert [e.token for e in event.logprobs] == list(event.tokens)
    assert tuple(e for event in outputs for e in event.logprobs) == done.logprobs
    offsets = [e.offset for e in done.logprobs]
    assert offsets == sorted(offsets) and all(0 <= o <= len(done.text) for o in offsets)
    starts, position = [], 0
    for event in outputs:  # an event starts with its first token (no tail before it)
        if event.tokens:
            starts.append((event.logprobs[0].offset, position))
        position += len(event.text)
    assert all(offset == start for offset, start in starts)


@pytest.mark.parametrize("proposer, k", [("prompt-lookup", 4), ("draft", 3)])
def test_a_greedy_speculative_request_reports_plain_decodings_logprobs(proposer, k):
    engine = tiny_engine()
    prompt = engine.tokenizer.encode(ECHO)
    settings = GenerationSettings(max_tokens=40, k=k, logprobs=TOP)
    events = run(engine, prompt, settings, proposer)
    done = events[-1]
    assert done.record.accepted > 3, "no drafts kept: the test would not cover them"
    assert_plain_logprobs(engine.target.model, prompt, done, TOP, proposer)
    check_events(events, done)


def test_a_draft_tree_reports_its_accepted_paths_rows():
    engine = tiny_engine()
    prompt = engine.tokenizer.encode(ECHO)
    settings = GenerationSettings(max_tokens=40, k=3, tree=True, logprobs=3)
    done = run(engine, prompt, settings, "draft")[-1]
    assert done.record.tree_rounds > 0 and done.record.accepted > 3
    assert_plain_logprobs(engine.target.model, prompt, done, 3, "tree")


def test_a_sampled_request_reports_the_models_own_logprob_of_each_drawn_token():
    """Not the tempered distribution it drew from: the model's, as plain decoding reports."""
    engine = tiny_engine()
    prompt = engine.tokenizer.encode(ECHO)
    sampling = SamplingSettings(temperature=0.8, seed=5)
    settings = GenerationSettings(max_tokens=30, k=3, sampling=sampling, logprobs=2)
    events = run(engine, prompt, settings, "draft")
    done = events[-1]
    assert done.record.accepted > 0
    assert_plain_logprobs(engine.target.model, prompt, done, 2, "sampled")
    check_events(events, done)


def test_batched_requests_each_report_their_own_rows():
    """Rows of different lengths and drafts share each pass; each reads its own rows, and
    a neighbour that did not ask gets none."""
    engine = tiny_engine()
    engine.add_proposer(PromptLookup("lookup", ngram_max=3, ngram_min=1, k_max=8))
    model, eos = engine.target.model, {VOCAB - 1}
    scheduler = Scheduler(engine, max_batch=4)
    prompts = [engine.tokenizer.encode(text) for text in (ECHO, "abc abc abc", "x", "hello")]
    asks = [TOP, 0, None, 4]
    ids = []
    for prompt, top in zip(prompts, asks):
        reference = plain_greedy(model, prompt, 30, eos)
        proposer = Oracle(len(prompt), reference, k_max=5) if top != 0 else "lookup"
        ids.append(
            scheduler.submit(prompt, GenerationSettings(max_tokens=30, k=4, logprobs=top), proposer)
        )
    events: dict[int, list] = {}
    for out in scheduler.drain():
        for request_id, got in out.items():
            events.setdefault(request_id, []).extend(got)
    for request_id, prompt, top in zip(ids, prompts, asks):
        done = events[request_id][-1]
        assert any(done.record.batch_sizes[2:]), "it never shared a pass"
        if top is None:
            assert done.logprobs is None
            assert all(
                e.logprobs is None for e in events[request_id] if isinstance(e, OUTPUT_EVENTS)
            )
            continue
        assert_plain_logprobs(model, prompt, done, top, f"row {request_id}")
        check_events(events[request_id], done)
    assert events[ids[0]][-1].record.accepted > 3


def test_without_logprobs_nothing_is_computed(monkeypatch):
    def refuse(*args):
        raise AssertionError("logprobs computed for a request that did not ask")

    monkeypatch.setattr(request, "pending_logprobs", refuse)
    engine = tiny_engine()
    events = run(engine, ECHO, GenerationSettings(max_tokens=20), "draft")
    assert all(e.logprobs is None for e in events if isinstance(e, OUTPUT_EVENTS))
    assert events[-1].logprobs is None


def test_a_token_cut_by_a_stop_string_is_not_reported():
    engine = tiny_engine()
    full = run(engine, ECHO, GenerationSettings(max_tokens=40), "prompt-lookup")[-1].text
    stop = full[10:13]  # ends the answer inside it
    settings = GenerationSettings(max_tokens=40, stop=[stop], logprobs=1)
    events = run(engine, ECHO, settings, "prompt-lookup")
    done = events[-1]
    assert done.record.finish_reason == "stop" and len(done.text) < len(full)
    assert [e.token for e in done.logprobs] == list(done.token_ids)
    check_events(events, done)


def test_a_plain_greedy_request_with_logprobs_gets_them_without_a_launched_pass():
    engine = tiny_engine()
    prompt = engine.tokenizer.encode(ECHO)
    done = run(engine, prompt, GenerationSettings(max_tokens=12, k=0, logprobs=1), None)[-1]
    assert_plain_logprobs(engine.target.model, prompt, done, 1, "plain")


@pytest.mark.parametrize("bad", [-1, 21])
def test_out_of_range_alternatives_are_refused(bad):
    with pytest.raises(GenerationError, match="logprobs"):
        GenerationSettings(logprobs=bad)


# The server: the official `openai` client against a real uvicorn, tiny models behind it.


@pytest.fixture(scope="module", params=[1, 4], ids=["alone", "batched"])
def base_url(request) -> Iterator[str]:
    with serving(TinyProvider(), limits=ServerLimits(max_batch=request.param)) as url:
        yield url


@pytest.fixture()
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=30)


def engine_logprobs(prompt, max_tokens: int, top: int) -> tuple:
    """What the engine alone reports for the request (its exactness is tested above)."""
    settings = GenerationSettings(max_tokens=max_tokens, k=4, logprobs=top)
    return list(server_engine("tiny").stream(prompt, settings, "prompt-lookup"))[-1].logprobs


def assert_chat_entries(content: list, expected: tuple, top: int) -> None:
    assert [c.token for c in content] == [e.text for e in expected]
    for got, entry in zip(content, expected):
        assert got.logprob == pytest.approx(entry.logprob, abs=TOLERANCE)
        assert got.bytes == list(entry.text.encode())
        assert [a.logprob for a in got.top_logprobs] == pytest.approx(
            [a.logprob for a in entry.top], abs=TOLERANCE
        )
        assert len(got.top_logprobs) == top


def test_chat_reports_each_tokens_logprob_and_alternatives(client):
    asked = dict(model="tiny", messages=[{"role": "user", "content": ECHO}], max_tokens=30)
    extra = dict(temperature=0, extra_body={"mlxspec": {"k": 4}})
    response = client.chat.completions.create(**asked, **extra, logprobs=True, top_logprobs=3)
    expected = engine_logprobs(asked["messages"], 30, 3)
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    assert_chat_entries(content, expected, 3)
    assert response.model_extra["x_mlxspec"]["accepted"] > 0  # the run record rides along

    chunks = list(
        client.chat.completions.create(**asked, **extra, logprobs=True, top_logprobs=3, stream=True)
    )
    streamed = [c for c in chunks if c.choices and c.choices[0].logprobs]
    assert_chat_entries([e for c in streamed for e in c.choices[0].logprobs.content], expected, 3)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == response.choices[0].message.content
    assert chunks[-1].model_extra["x_mlxspec"]["accepted"] > 0

    plain = client.chat.completions.create(**asked, **extra)
    assert plain.choices[0].logprobs is None  # not asked: not reported


def test_text_completions_report_the_legacy_lists(client):
    asked = dict(model="tiny", prompt=ECHO, max_tokens=30, temperature=0, logprobs=2)
    extra = dict(extra_body={"mlxspec": {"k": 4}})
    answer = client.completions.create(**asked, **extra).choices[0]
    expected = engine_logprobs(ECHO, 30, 2)
    logprobs = answer.logprobs
    assert logprobs.tokens == [e.text for e in expected]
    assert logprobs.token_logprobs == pytest.approx([e.logprob for e in expected], abs=TOLERANCE)
    assert logprobs.text_offset == [e.offset for e in expected]
    for alternatives, entry in zip(logprobs.top_logprobs, expected):
        assert alternatives[entry.text] == pytest.approx(entry.logprob, abs=TOLERANCE)
        assert 1 <= len(alternatives) <= 3  # the 2 likeliest and the chosen (texts may repeat)
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset[-1] < len(answer.text)

    chunks = [c.choices[0] for c in client.completions.create(**asked, **extra, stream=True)]
    streamed = [c.logprobs for c in chunks if c.logprobs]
    assert [t for s in streamed for t in s.tokens] == logprobs.tokens
    assert [o for s in streamed for o in s.text_offset] == logprobs.text_offset
    assert [p for s in streamed for p in s.token_logprobs] == logprobs.token_logprobs


@pytest.mark.parametrize(
    "path, body, param",
    [
        (CHAT, {"messages": HELLO, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        (CHAT, {"messages": HELLO, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        (CHAT, {"messages": HELLO, "top_logprobs": 2}, "top_logprobs"),
        (CHAT, {"messages": HELLO, "logprobs": False, "top_logprobs": 2}, "top_logprobs"),
        (CHAT, {"messages": HELLO, "logprobs": 3}, "logprobs"),
        (TEXT, {"prompt": "hi", "logprobs": 6}, "logprobs"),
        (TEXT, {"prompt": "hi", "logprobs": True}, "logprobs"),
    ],
)
def test_bad_logprobs_get_a_400_in_openais_shape(base_url, path, body, param):
    response = httpx.post(base_url + path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_value" and error["param"] == param
    assert error["type"] == "invalid_request_error" and param in error["message"]


def assert_one_process_logprobs(root: Path, client: openai.OpenAI) -> None:
    """`serve --ranks 2` on `root`'s tiny llama: rank 0 reads the logprobs of its verify
    rows (the other ranks none), alone or in its batch, and they are one process's plain
    decoding's. Asked of the sharded servers of test_distributed.py (one at a time and
    batched): a server of its own cost two rank launches more."""
    loaded = load_model(str(root / "llama"), progress=False)
    plain = Engine(loaded.model, loaded.tokenizer, "tiny")
    prompt = SERVE_PROMPTS[0]
    settings = GenerationSettings(max_tokens=24, logprobs=2)
    expected = list(plain.stream(prompt, settings))[-1].logprobs
    # A fixed k drafts whatever the server's policy learned from the requests before this
    # one (adaptive, a lone row after a batch's busy rounds once drafted nothing).
    fixed = {"mlxspec": {"proposer": "prompt-lookup", "k": 4}}
    answer = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=24, temperature=0, logprobs=2, extra_body=fixed
    )
    logprobs = answer.choices[0].logprobs
    assert answer.model_extra["x_mlxspec"]["ranks"] == 2
    assert answer.model_extra["x_mlxspec"]["accepted"] > 0  # drafts were kept and reported
    assert logprobs.tokens == [e.text for e in expected]
    assert logprobs.token_logprobs == pytest.approx([e.logprob for e in expected], abs=TOLERANCE)
    for alternatives, entry in zip(logprobs.top_logprobs, expected):
        assert alternatives == pytest.approx(
            {**{a.text: a.logprob for a in entry.top}, entry.text: entry.logprob}, abs=TOLERANCE
        )
