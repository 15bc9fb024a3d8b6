"""`mlxspec serve`: a real uvicorn server on a free port, tiny random models, and the
official `openai` client (raw httpx where a client would refuse to send the request)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace

import httpx
import openai
import pytest
from test_units import CPU_LIKE_COST
from tiny_models import byte_tokenizer, tiny_model

from mlxspec.decoding.engine import Engine, GenerationSettings
from mlxspec.events import OUTPUT_EVENTS, Accepted, Done
from mlxspec.proposers import DraftModel, PromptLookup, truncated_model
from mlxspec.registry.models_toml import Defaults, Registry, parse_registry_text
from mlxspec.server import ModelInfo, RegistryProvider, ServerLimits, create_app
from mlxspec.server.background import serving_in_thread
from mlxspec.server.providers import NotDownloaded

SEEDS = {"tiny": 0, "tiny-b": 3}
CONTEXT = 1024
ECHO = "one two one two one two"  # the tiny llamas answer it at length, with drafts
HELLO = [{"role": "user", "content": "hi"}]
CHAT, TEXT = "/v1/chat/completions", "/v1/completions"


class RecordingEngine(Engine):
    """An engine that remembers whether each run went to its end or was closed early."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.runs: list[dict] = []

    def stream(self, *args, **kwargs):
        run = {"finished": False, "events": [], "prompt": args[0] if args else None}
        run["settings"] = args[1] if len(args) > 1 else None
        self.runs.append(run)
        for event in super().stream(*args, **kwargs):
            run["events"].append(event)
            yield event
        run["finished"] = True


def tiny_engine(name: str) -> RecordingEngine:
    """Prompt lookup, and a draft model (its own first two layers) that drafts trees."""
    model = tiny_model("llama", seed=SEEDS[name])
    draft = DraftModel(truncated_model(model, 2), name="draft", k_max=4)
    return RecordingEngine(
        model, byte_tokenizer(), name, [PromptLookup(), draft], verify_cost=CPU_LIKE_COST
    )


class TinyRuntime:
    def __init__(self, name: str):
        self.engine = tiny_engine(name)

    def proposer(self, name: str | None) -> str:
        return "prompt-lookup" if name is None else name


class TinyProvider:
    """Two tiny llamas behind the server's model-provider interface, and one that
    is listed but "not downloaded"."""

    default = "tiny"

    def __init__(self, max_tokens: int = 32, context: int = CONTEXT):
        defaults = Defaults(max_tokens=max_tokens, context=context)
        self.models = {
            name: ModelInfo(name, ("prompt-lookup", "draft", "none"), defaults)
            for name in [*SEEDS, "tiny-absent"]
        }
        self.opened: list[TinyRuntime] = []

    def check(self, name: str, proposer: str | None) -> None:
        if name == "tiny-absent":
            raise NotDownloaded("tiny-absent is not downloaded; run `mlxspec pull tiny-absent`")

    def open(self, name: str) -> TinyRuntime:
        self.opened.append(TinyRuntime(name))
        return self.opened[-1]

    @property
    def engine(self) -> RecordingEngine:
        return self.opened[-1].engine


def direct_answer(prompt, max_tokens: int, model: str = "tiny", **settings) -> str:
    """What the engine alone says, with no server in between."""
    events = tiny_engine(model).stream(
        prompt, GenerationSettings(max_tokens=max_tokens, **settings), "prompt-lookup"
    )
    return next(e for e in events if isinstance(e, Done)).text


@contextmanager
def serving(provider: TinyProvider, **options) -> Iterator[str]:
    """A uvicorn server on a free port in a background thread; its base URL."""
    app = create_app(provider, **options)
    with serving_in_thread(app) as url:
        yield url
    assert not app.state.worker.thread.is_alive(), "the worker outlived the server"


@pytest.fixture(scope="module")
def provider() -> TinyProvider:
    return TinyProvider()


@pytest.fixture(scope="module")
def base_url(provider) -> Iterator[str]:
    with serving(provider) as url:
        yield url


@pytest.fixture()
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=30)


def chat(client, content: str, max_tokens: int = 24, **extra):
    return client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": content}],
        max_tokens=max_tokens,
        temperature=0,
        **extra,
    )


def wait_until_idle(base_url: str, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while httpx.get(f"{base_url}/health").json()["busy"]:
        assert time.monotonic() < deadline, "the engine stayed busy"
        time.sleep(0.02)


def test_lists_the_providers_models(client):
    assert [model.id for model in client.models.list()] == ["tiny", "tiny-b", "tiny-absent"]
    assert client.models.retrieve("tiny-b").id == "tiny-b"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("huge")


def test_a_request_can_ask_for_draft_trees(client):
    tree = {"tree": True, "proposer": "draft", "k": 3}  # a fixed k: it drafts every round
    response = chat(client, ECHO, max_tokens=40, extra_body={"mlxspec": tree})
    record = response.model_extra["x_mlxspec"]
    assert record["tree"] is True and record["tree_unavailable"] == ""
    assert record["tree_rounds"] > 0 and record["tree_nodes"] >= record["tree_rounds"]
    assert response.choices[0].message.content == direct_answer(
        [{"role": "user", "content": ECHO}], 40
    )


def test_a_request_can_turn_the_history_off(client, provider):
    chat(client, ECHO, extra_body={"mlxspec": {"history": False}})
    chat(client, ECHO)
    assert [run["settings"].history for run in provider.engine.runs[-2:]] == [False, True]


def test_penalties_reach_the_engine_and_the_record(client, provider):
    """A request's presence and frequency penalties over the model's defaults (Qwen3.5's
    presence_penalty), with mlx-lm's windows; the run record reports what was used."""
    defaults = provider.models["tiny"].defaults
    provider.models["tiny"] = replace(
        provider.models["tiny"], defaults=replace(defaults, presence_penalty=1.5)
    )
    try:
        asked = {"frequency_penalty": -0.5, "extra_body": {"frequency_context_size": 64}}
        asked["logit_bias"] = {}  # what some clients send: accepted (a bias is refused)
        record = chat(client, ECHO, max_tokens=4, **asked).model_extra["x_mlxspec"]
        text = client.completions.create(
            model="tiny", prompt=ECHO, max_tokens=4, presence_penalty=0
        )
    finally:
        provider.models["tiny"] = replace(provider.models["tiny"], defaults=defaults)
    penalties = ("presence_penalty", "presence_context_size")
    penalties += ("frequency_penalty", "frequency_context_size")
    assert [record["sampling"][key] for key in penalties] == [1.5, 20, -0.5, 64]
    sampling = provider.engine.runs[-1]["settings"].sampling
    assert (sampling.presence_penalty, sampling.frequency_penalty) == (0, 0)
    assert text.model_extra["x_mlxspec"]["sampling"]["presence_penalty"] == 0


def test_chat_answer_is_the_engines_with_usage_and_run_record(client):
    response = chat(client, ECHO, max_tokens=40, extra_body={"mlxspec": {"k": 4}})
    answer = response.choices[0].message.content
    assert answer == direct_answer([{"role": "user", "content": ECHO}], 40, k=4)
    record = response.model_extra["x_mlxspec"]
    assert record["proposer"] == "prompt-lookup" and record["lossless"] is True
    assert record["drafted"] > 0 and 0 <= record["acceptance_rate"] <= 1
    assert response.usage.completion_tokens == record["completion_tokens"]
    assert response.usage.prompt_tokens == record["prompt_tokens"] > 0
    assert response.choices[0].finish_reason == record["finish_reason"]


def test_stream_says_what_the_plain_answer_says_with_provenance_and_usage(client, provider):
    plain = chat(client, ECHO, max_tokens=64).choices[0].message.content
    chunks = list(
        chat(
            client,
            ECHO,
            max_tokens=64,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"mlxspec": {"provenance": True}},
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(d.content for d in deltas) == plain
    marks = [d.model_extra["x_mlxspec"]["provenance"] for d in deltas]
    assert {"accepted", "target"} == set(marks)
    # Piece by piece, the marks are the engine's own events for this very request.
    events = provider.engine.runs[-1]["events"]
    expected = [
        (e.text, "accepted" if isinstance(e, Accepted) else "target")
        for e in events
        if isinstance(e, OUTPUT_EVENTS) and e.text
    ]
    assert [(d.content, mark) for d, mark in zip(deltas, marks)] == expected
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].model_extra["x_mlxspec"]["accepted"] > 0
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


def test_text_completion_takes_text_or_token_ids(client):
    answer = client.completions.create(model="tiny", prompt=ECHO, max_tokens=20, temperature=0)
    assert answer.choices[0].text == direct_answer(ECHO, 20)
    by_ids = client.completions.create(
        model="tiny", prompt=byte_tokenizer().encode(ECHO), max_tokens=20, temperature=0
    )
    assert by_ids.choices[0].text == answer.choices[0].text
    streamed = client.completions.create(
        model="tiny", prompt=ECHO, max_tokens=20, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == answer.choices[0].text


def test_stop_string_ends_the_answer_before_it(client):
    full = chat(client, ECHO, max_tokens=40).choices[0].message.content
    stop = full[10:13]
    response = chat(client, ECHO, max_tokens=40, stop=[stop])
    assert response.choices[0].message.content == full[: full.index(stop)]
    assert response.choices[0].finish_reason == "stop"


def test_concurrent_clients_each_get_their_own_answer(client):
    prompts = [f"{word} {word} {word}" for word in ("alpha", "beta", "gamma", "delta")]
    alone = [chat(client, p).choices[0].message.content for p in prompts]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda p: chat(client, p).choices[0].message.content, prompts))
    assert together == alone


def test_a_client_that_leaves_mid_stream_frees_the_engine(client, base_url, provider):
    stream = chat(client, ECHO, max_tokens=3000, stream=True)
    pieces = iter(stream)
    for _ in range(3):
        next(pieces)
    stream.close()
    wait_until_idle(base_url)
    assert provider.engine.runs[-1]["finished"] is False  # closed between rounds, not run out
    started = time.monotonic()
    assert chat(client, ECHO, max_tokens=8).choices[0].message.content
    assert time.monotonic() - started < 5.0


def test_a_client_that_gives_up_is_stopped_while_running_and_skipped_while_waiting(
    client, base_url, provider
):
    long_request = {"messages": [{"role": "user", "content": ECHO}], "max_tokens": 3000}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(base_url + CHAT, json=long_request, timeout=0.5)
    wait_until_idle(base_url)
    runs = provider.engine.runs
    assert runs[-1]["finished"] is False

    before = len(runs)
    holding = chat(client, ECHO, max_tokens=3000, stream=True)
    next(iter(holding))
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(base_url + CHAT, json=long_request, timeout=0.5)
    holding.close()
    wait_until_idle(base_url)
    assert httpx.get(f"{base_url}/health").json()["waiting"] == 0
    assert len(runs) == before + 1  # the holder ran; the one that gave up waiting never did


def test_a_request_for_another_model_loads_it(client, base_url):
    messages = [{"role": "user", "content": ECHO}]
    other = client.chat.completions.create(
        model="tiny-b", messages=messages, max_tokens=16, temperature=0
    )
    assert other.choices[0].message.content == direct_answer(messages, 16, model="tiny-b")
    assert httpx.get(f"{base_url}/health").json()["model"] == "tiny-b"
    back = client.chat.completions.create(messages=messages, max_tokens=16, model="tiny")
    assert back.model == "tiny" and httpx.get(f"{base_url}/health").json()["model"] == "tiny"


def test_a_model_that_is_not_downloaded_is_refused_without_unloading(client, base_url, provider):
    opened = len(provider.opened)
    with pytest.raises(openai.NotFoundError, match="mlxspec pull tiny-absent"):
        client.chat.completions.create(model="tiny-absent", messages=HELLO, max_tokens=4)
    assert httpx.get(f"{base_url}/health").json()["model"] == "tiny"
    assert chat(client, ECHO, max_tokens=4) and len(provider.opened) == opened


def test_registry_provider_serves_entries_and_refuses_missing_downloads(tmp_path):
    text = """
default = "here"
[models.here]
target = "smollm2-135m"
[models.absent]
target = "nobody/surely-not-downloaded"
[models.absent.proposers.draft-model]
draft = "nobody/also-absent"
"""
    entries, default = parse_registry_text(text, tmp_path / "models.toml")
    provider = RegistryProvider(Registry(entries, default, (tmp_path / "models.toml",)))
    assert provider.default == "here" and set(provider.models) == {"here", "absent"}
    assert provider.models["absent"].proposers == ("draft-model", "prompt-lookup", "suffix", "none")
    provider.check("here", None)  # the default model may download: the operator chose it
    with pytest.raises(NotDownloaded, match="nobody/surely-not-downloaded, nobody/also-absent"):
        provider.check("absent", "draft-model")


TOO_LONG = "x" * (CONTEXT + 10)  # for the model's context, in the byte tokenizer's tokens
BAD_REQUESTS = [
    # (path, body (bytes are sent raw), status, code)
    (CHAT, b"{not json", 400, "invalid_json"),
    (CHAT, b"", 400, "invalid_body"),
    (CHAT, b"[1, 2]", 400, "invalid_body"),
    (CHAT, {}, 400, "invalid_value"),
    (CHAT, {"messages": []}, 400, "invalid_value"),
    (CHAT, {"messages": "hi"}, 400, "invalid_value"),
    (CHAT, {"messages": [{"role": "user"}]}, 400, "invalid_value"),
    (CHAT, {"messages": [{"role": "robot", "content": "hi"}]}, 400, "invalid_value"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "invalid_value"),
    (CHAT, {"messages": HELLO, "max_tokens": -1}, 400, "invalid_value"),
    (CHAT, {"messages": HELLO, "max_tokens": "ten"}, 400, "invalid_value"),
    (CHAT, {"messages": HELLO, "temperature": -0.5}, 400, "invalid_value"),
    (CHAT, {"messages": HELLO, "top_p": 0}, 400, "invalid_value"),
    (CHAT, {"messages": HELLO, "presence_penalty": 2.5}, 400, "invalid_value"),
    (CHAT, {"messages": HELLO, "frequency_penalty": -2.01}, 400, "invalid_value"),
    (CHAT, {"messages": HELLO, "frequency_penalty": "high"}, 400, "invalid_value"),
    (TEXT, {"prompt": "hi", "presence_penalty": -3}, 400, "invalid_value"),
    (TEXT, {"prompt": "hi", "frequency_penalty": 2.5}, 400, "invalid_value"),
    (TEXT, {"prompt": "hi", "presence_context_size": 0}, 400, "invalid_value"),
    (TEXT, {"prompt": "hi", "frequency_context_size": 2**31}, 400, "invalid_value"),
    (CHAT, {"messages": HELLO, "logit_bias": {"65": -100}}, 400, "invalid_value"),
    (CHAT, {"messages": HELLO, "n": 2}, 400, "invalid_value"),
    (CHAT, {"messages": HELLO, "stop": 3}, 400, "invalid_value"),
    (CHAT, {"messages": HELLO, "stop": ["a", "b", "c", "d", "e"]}, 400, "invalid_value"),
    (CHAT, {"messages": HELLO, "stream": "yes"}, 400, "invalid_value"),
    (CHAT, {"messages": HELLO, "model": "huge"}, 404, "model_not_found"),
    (CHAT, {"messages": HELLO, "mlxspec": {"proposer": "oracle"}}, 400, "invalid_proposer"),
    (CHAT, {"messages": HELLO, "mlxspec": {"k": -1}}, 400, "invalid_value"),
    (CHAT, {"messages": HELLO, "mlxspec": {"draft": 4}}, 400, "invalid_value"),
    (CHAT, {"messages": HELLO, "mlxspec": {"history": "no"}}, 400, "invalid_value"),
    # OpenAI's code for it, which clients act on (trim, compact)
    (CHAT, {"messages": [{"role": "user", "content": TOO_LONG}]}, 400, "context_length_exceeded"),
    (
        CHAT,
        {"messages": [{"role": "user", "content": TOO_LONG}], "stream": True},
        400,
        "context_length_exceeded",
    ),
    (TEXT, {"prompt": TOO_LONG, "stream": True}, 400, "context_length_exceeded"),
    (CHAT, {"messages": HELLO, "pad": "x" * (2 << 20)}, 413, "too_large"),
    (TEXT, {"prompt": ""}, 400, "invalid_value"),
    (TEXT, {"prompt": []}, 400, "invalid_value"),
    (TEXT, {"prompt": ["one", "two"]}, 400, "invalid_value"),
    (TEXT, {"prompt": [1, -2]}, 400, "invalid_value"),
    (TEXT, {"prompt": [1, 99999]}, 400, "invalid_value"),
    (TEXT, {"messages": HELLO}, 400, "invalid_value"),
    ("/v1/nowhere", {}, 404, "not_found"),
]


@pytest.mark.parametrize("path, body, status, code", BAD_REQUESTS)
def test_bad_requests_get_a_clear_4xx_in_openais_shape(base_url, path, body, status, code):
    if isinstance(body, bytes):
        response = httpx.post(
            base_url + path, content=body, headers={"Content-Type": "application/json"}
        )
    else:
        response = httpx.post(base_url + path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert error["code"] == code and isinstance(error["type"], str)
    assert httpx.get(f"{base_url}/health").json()["status"] == "ok"


def test_wrong_method_is_refused_in_openais_shape(base_url):
    response = httpx.get(f"{base_url}{CHAT}")
    assert response.status_code == 405 and response.json()["error"]["code"] == "method_not_allowed"


def test_a_max_tokens_over_the_servers_limit_is_clipped_to_it_not_refused():
    """Agents ask for 32,000 whatever the model (Qwen Code, Claude Code): what the server
    grants is its limit, and the record says so."""
    with serving(TinyProvider(), limits=ServerLimits(max_tokens=6)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)
        answer = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=32000)
    assert answer.model_extra["x_mlxspec"]["max_tokens"] == 6
    assert answer.usage.completion_tokens <= 6


def test_api_key_is_required_when_set():
    with serving(TinyProvider(), api_key="sesame") as url:
        assert httpx.get(f"{url}/v1/models").status_code == 401
        refused = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer wrong"})
        assert refused.status_code == 401 and refused.headers["WWW-Authenticate"] == "Bearer"
        assert refused.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{url}/health").status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
        keyed = openai.OpenAI(base_url=f"{url}/v1", api_key="sesame", max_retries=0)
        assert chat(keyed, "hi", max_tokens=4).choices[0].message.content is not None


def test_a_full_queue_answers_429_and_loses_nothing():
    with serving(TinyProvider(), limits=ServerLimits(max_waiting=1)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        running = chat(client, ECHO, max_tokens=3000, stream=True)
        next(iter(running))  # the first request holds the engine
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(chat, client, ECHO, 12)
            deadline = time.monotonic() + 5
            while httpx.get(f"{url}/health").json()["waiting"] < 1:
                assert time.monotonic() < deadline, "the second request never queued"
                time.sleep(0.01)
            refused = httpx.post(f"{url}{CHAT}", json={"messages": HELLO})
            assert refused.status_code == 429, refused.text
            assert int(refused.headers["Retry-After"]) >= 1
            assert refused.json()["error"]["code"] == "queue_full"
            running.close()
            answer = waiting.result(timeout=20).choices[0].message.content
        assert answer == direct_answer([{"role": "user", "content": ECHO}], 12)


def test_fuzzed_requests_never_get_a_5xx():
    """Schemathesis cases from the app's own OpenAPI schema, in process."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings
    from schemathesis.python import asgi

    app = create_app(TinyProvider(max_tokens=4), limits=ServerLimits(max_tokens=8))
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    modes = schemathesis.GenerationMode
    try:
        for operation in [result.ok() for result in schema.get_all_operations()]:
            # Without a body, a GET has no wrong input to make up (unsatisfiable).
            for mode in (modes.POSITIVE, modes.NEGATIVE) if operation.body else (modes.POSITIVE,):

                @given(case=operation.as_strategy(generation_mode=mode))
                @settings(
                    max_examples=10,
                    deadline=None,
                    database=None,
                    suppress_health_check=list(HealthCheck),
                )
                def check(case):
                    response = case.call()
                    assert response.status_code < 500, (case.as_curl_command(), response.text)
                    if response.status_code >= 400:
                        error = json.loads(response.text)["error"]
                        # Ollama's routes say it as {"error": "..."}, the others' as an object
                        assert error if case.path.startswith("/api/") else error["message"]

                check()
    finally:
        asgi.shutdown_lifespans()
    assert not app.state.worker.thread.is_alive()
