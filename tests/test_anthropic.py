"""Anthropic's Messages API: the translations on their own (requests in; messages, stream
events and errors out, read back by the official `anthropic` client through a mock
transport), then the real server driven by that client."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator

import anthropic
import httpx
import pytest
from fastapi import FastAPI, Response
from test_server import TinyProvider, serving, tiny_engine
from test_tool_calls import ScriptedProvider, plain_answer

from mlxspec.decoding.engine import GenerationSettings
from mlxspec.events import Bonus, Done, RunRecord
from mlxspec.markup.conversation import (
    AnswerText,
    ParsedAnswer,
    ReasoningText,
    ToolCall,
    ToolCallArguments,
    ToolCallStarted,
)
from mlxspec.markup.output_parser import Answered, PartsOf
from mlxspec.server import ServerLimits
from mlxspec.server.anthropic.routes import _events
from mlxspec.server.anthropic.translate import (
    CountTokensRequest,
    MessageStream,
    answer_constraint,
    conversation,
    error_event,
    message,
)
from mlxspec.server.background import serving_in_thread
from mlxspec.server.errors import ApiError

WEATHER = {
    "name": "weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def translated(template_defaults: dict | None = None, **body):
    request = CountTokensRequest.model_validate({"model": "tiny", **body})
    return conversation(request, template_defaults or {})


def refusal(**body) -> ApiError:
    with pytest.raises(ApiError) as refused:
        translated(**body)
    assert refused.value.status_code == 400
    return refused.value


# --- Requests in ------------------------------------------------------------------------


def test_a_tool_exchange_becomes_chat_template_messages():
    turns = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Ask the tool.", "signature": "sig"},
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "P"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": [{"type": "text", "text": "sunny"}],
                },
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
    ]
    system = [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}]
    talk = translated(
        {"enable_thinking": True, "other": 1},
        system=system,
        messages=turns,
        tools=[WEATHER],
        thinking={"type": "disabled"},
    )
    call = {
        "id": "toolu_1",
        "type": "function",
        "function": {"name": "weather", "arguments": {"city": "P"}},
    }
    assert talk.messages == [
        {"role": "system", "content": "Be brief.\nBe kind."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "reasoning_content": "Ask the tool.",
            "tool_calls": [call],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "name": "weather", "content": "sunny"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    function = {
        "name": "weather",
        "description": "The weather in a city",
        "parameters": WEATHER["input_schema"],
    }
    assert talk.tools == [{"type": "function", "function": function}]
    assert talk.template_kwargs == {"enable_thinking": False, "other": 1}  # the model's yield


def test_tool_choice_none_keeps_the_tools_from_the_model():
    talk = translated(
        messages=[{"role": "user", "content": "hi"}], tools=[WEATHER], tool_choice={"type": "none"}
    )
    assert talk.tools is None and talk.template_kwargs == {}


@pytest.mark.parametrize(
    "tools, choice, says",
    [
        ([WEATHER], {"type": "tool", "name": "time"}, "no tool named 'time' is in tools"),
        ([], {"type": "any"}, "tools are empty"),
    ],
)
def test_forcing_a_tool_needs_it_among_the_tools(tools, choice, says):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    request = CountTokensRequest.model_validate({**body, "tools": tools, "tool_choice": choice})
    with pytest.raises(ApiError) as refused:
        answer_constraint(request)
    assert refused.value.param == "tool_choice" and says in refused.value.message
    forced = {**body, "tools": [WEATHER], "tool_choice": {"type": "any"}}
    assert answer_constraint(CountTokensRequest.model_validate(forced)).tools.names == ("weather",)


def test_a_tool_result_must_answer_an_earlier_tool_use():
    result = {"type": "tool_result", "tool_use_id": "toolu_9", "content": "sunny"}
    error = refusal(messages=[{"role": "user", "content": [result]}])
    assert "toolu_9" in error.message and error.param == "messages[0].content[0].tool_use_id"


def test_an_image_is_refused_with_a_reason():
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    error = refusal(messages=[{"role": "user", "content": [image]}])
    assert error.message == "messages[0].content[0]: image blocks are not supported by this server"


# --- Answers out ------------------------------------------------------------------------


def finished(reason: str = "stop", stop_string: str | None = None) -> RunRecord:
    record = RunRecord(model="tiny", proposer="none", speculative=False, sampling={})
    record.prompt_tokens, record.completion_tokens = 7, 5
    record.finish_reason, record.stop_string = reason, stop_string
    return record


@pytest.fixture(scope="module")
def replay() -> Iterator[Callable[[bytes, str], anthropic.Anthropic]]:
    """The official client, answered by a server that replays the body it is given: the
    client reads what the translations wrote, as it would read the real server."""
    canned: dict[str, object] = {}
    app = FastAPI()

    @app.post("/v1/messages")
    async def answer() -> Response:
        return Response(canned["body"], media_type=canned["type"])

    def client(body: bytes, content_type: str) -> anthropic.Anthropic:
        canned.update(body=body, type=content_type)
        return anthropic.Anthropic(base_url=url, api_key="k", max_retries=0)

    with serving_in_thread(app) as url:
        yield client


ASK = {"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}


def test_a_whole_answer_reads_back_as_the_clients_message(replay):
    answer = ParsedAnswer("hmm", "Sunny.", (ToolCall("call_0", "weather", '{"city": "P"}'),))
    body = message("msg_1", "tiny", answer, finished())
    read = replay(json.dumps(body).encode(), "application/json").messages.create(**ASK)
    assert [block.type for block in read.content] == ["thinking", "text", "tool_use"]
    assert read.content[0].thinking == "hmm" and read.content[1].text == "Sunny."
    assert read.content[2].input == {"city": "P"} and read.content[2].id.startswith("toolu_")
    assert read.stop_reason == "tool_use" and read.stop_sequence is None
    assert (read.usage.input_tokens, read.usage.output_tokens) == (7, 5)
    assert body["x_mlxspec"]["finish_reason"] == "stop"


@pytest.mark.parametrize(
    "record, reason, sequence",
    [
        (finished("length"), "max_tokens", None),
        (finished("stop", "END"), "stop_sequence", "END"),
        (finished("stop"), "end_turn", None),
    ],
)
def test_why_an_answer_stopped(record, reason, sequence):
    body = message("msg_1", "tiny", ParsedAnswer("", "x"), record)
    assert (body["stop_reason"], body["stop_sequence"]) == (reason, sequence)


def test_a_malformed_tool_call_keeps_its_text():
    answer = ParsedAnswer("", "", (ToolCall("call_0", "weather", "{city: P"),))
    body = message("msg_1", "tiny", answer, finished())
    assert body["content"][0]["input"] == {"_arguments": "{city: P"}


def streamed(parts, record: RunRecord) -> bytes:
    stream = MessageStream("msg_1", "tiny", record.prompt_tokens)
    events = [*stream.opening()]
    for part in parts:
        events += stream.part(part)
    return "".join([*events, *stream.closing(record)]).encode()


def event_names(sse: bytes) -> list[str]:
    lines = sse.decode().splitlines()
    return [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]


def test_streamed_parts_become_content_blocks_the_client_reassembles(replay):
    parts = [
        ReasoningText("Ask "),
        ReasoningText("the tool."),
        AnswerText(""),
        AnswerText("Looking."),
        ToolCallStarted(0, "call_0", "weather"),
        ToolCallArguments(0, '{"city": '),
        ToolCallArguments(0, '"P"}'),
        ToolCallStarted(1, "call_1", "weather"),
        ToolCallArguments(1, '{"city": "R"}'),
    ]
    sse = streamed(parts, finished())
    blocks = ["content_block_start", "content_block_delta"]
    assert event_names(sse) == [
        "message_start",
        "ping",
        *blocks,
        "content_block_delta",
        "content_block_stop",
        *blocks,
        "content_block_stop",
        *blocks,
        "content_block_delta",
        "content_block_stop",
        *blocks,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    with replay(sse, "text/event-stream").messages.stream(**ASK) as stream:
        read = stream.get_final_message()
    assert [block.type for block in read.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert read.content[0].thinking == "Ask the tool." and read.content[1].text == "Looking."
    assert [block.input for block in read.content[2:]] == [{"city": "P"}, {"city": "R"}]
    assert read.stop_reason == "tool_use"
    assert (read.usage.input_tokens, read.usage.output_tokens) == (7, 5)


def test_a_stream_that_stopped_at_a_stop_sequence_says_which(replay):
    sse = streamed([AnswerText("abc")], finished("stop", "END"))
    with replay(sse, "text/event-stream").messages.stream(**ASK) as stream:
        read = stream.get_final_message()
    assert (read.stop_reason, read.stop_sequence) == ("stop_sequence", "END")
    assert read.content[0].text == "abc"


def test_an_error_mid_stream_is_anthropics_error_event(replay):
    sse = error_event(ApiError(503, "the server is shutting down", type="server_error"))
    with pytest.raises(anthropic.APIStatusError) as raised:
        with replay(sse.encode(), "text/event-stream").messages.stream(**ASK) as stream:
            stream.get_final_message()
    assert raised.value.body == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "the server is shutting down"},
    }


# --- The real server --------------------------------------------------------------------

ECHO = "one two one two one two"
HELLO = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    with serving(TinyProvider(), api_key="sesame", preload="tiny") as url:
        yield url


@pytest.fixture()
def client(base_url) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key="sesame", max_retries=0, timeout=30)


def plain_decoding(messages: list[dict], max_tokens: int) -> Done:
    """The target alone, greedy, no drafts."""
    events = tiny_engine("tiny").stream(messages, GenerationSettings(max_tokens=max_tokens), "none")
    return next(event for event in events if isinstance(event, Done))


def ask(client, content: str | list = ECHO, max_tokens: int = 24, **extra):
    messages = [{"role": "user", "content": content}] if isinstance(content, str) else content
    return client.messages.create(model="tiny", max_tokens=max_tokens, messages=messages, **extra)


def assert_serving(base_url: str) -> None:
    assert httpx.get(f"{base_url}/health").json()["status"] == "ok"


def test_a_plain_answer_is_plain_decodings(client):
    answer = ask(client)
    plain = plain_decoding([{"role": "user", "content": ECHO}], 24)
    assert answer.content[0].text == plain.text and answer.id.startswith("msg_")
    assert answer.model == "tiny" and answer.role == "assistant"
    assert answer.usage.output_tokens == len(plain.token_ids)
    assert answer.usage.input_tokens == plain.record.prompt_tokens
    assert answer.stop_reason == "max_tokens" and answer.x_mlxspec["lossless"] is True


def test_a_streamed_answer_says_what_the_whole_one_says(client, base_url):
    whole = ask(client)
    with client.messages.stream(
        model="tiny", max_tokens=24, messages=[{"role": "user", "content": ECHO}]
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.usage == whole.usage and final.stop_reason == whole.stop_reason
    raw = httpx.post(
        f"{base_url}/v1/messages",
        json={"model": "tiny", "max_tokens": 4, "messages": HELLO, "stream": True},
        headers={"x-api-key": "sesame"},
    )
    names = event_names(raw.content)
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    start = json.loads(raw.text.split("data: ")[1].splitlines()[0])  # as older clients read it
    prompt_tokens = plain_decoding(HELLO, 4).record.prompt_tokens
    assert start["message"]["usage"]["input_tokens"] == prompt_tokens
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_a_system_prompt_and_earlier_turns_reach_the_model(client):
    turns = [
        {"role": "user", "content": "one two"},
        {"role": "assistant", "content": [{"type": "text", "text": "one two"}]},
        {"role": "user", "content": [{"type": "text", "text": ECHO}]},
    ]
    answer = ask(client, turns, system="Repeat.")
    plain = plain_decoding(
        [
            {"role": "system", "content": "Repeat."},
            *[
                {"role": "user", "content": "one two"},
                {"role": "assistant", "content": "one two"},
                {"role": "user", "content": ECHO},
            ],
        ],
        24,
    )
    assert answer.content[0].text == plain.text
    assert answer.usage.input_tokens == plain.record.prompt_tokens


def test_a_stop_sequence_ends_the_answer_and_is_named(client):
    plain = plain_decoding([{"role": "user", "content": ECHO}], 24).text
    # Two characters from the first that is new: the answer before them is not empty.
    stop = next(plain[i : i + 2] for i in range(1, len(plain) - 1) if plain[i] not in plain[:i])
    answer = ask(client, stop_sequences=["never there", stop])
    assert answer.content[0].text == plain[: plain.index(stop)]
    assert (answer.stop_reason, answer.stop_sequence) == ("stop_sequence", stop)


def test_count_tokens_counts_what_the_model_is_given(client):
    turns = [{"role": "user", "content": ECHO}]
    counted = client.messages.count_tokens(model="tiny", messages=turns, system="Repeat.")
    answer = ask(client, turns, max_tokens=2, system="Repeat.")
    # What the prompt cache held is counted apart, as Anthropic counts its cache reads.
    read = answer.usage.cache_read_input_tokens
    assert counted.input_tokens == answer.usage.input_tokens + read
    alone = client.messages.count_tokens(model="tiny", messages=turns)
    assert alone.input_tokens < counted.input_tokens


def test_the_key_may_come_as_x_api_key_or_bearer(base_url):
    for header in ({"x-api-key": "sesame"}, {"Authorization": "Bearer sesame"}):
        body = {"model": "tiny", "max_tokens": 2, "messages": HELLO}
        assert httpx.post(f"{base_url}/v1/messages", json=body, headers=header).is_success
    wrong = anthropic.Anthropic(base_url=base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as refused:
        ask(wrong, max_tokens=2)
    assert refused.value.body["error"]["type"] == "authentication_error"
    assert_serving(base_url)


def raw_post(base_url: str, body: dict, path: str = "/v1/messages") -> httpx.Response:
    headers = {"x-api-key": "sesame", "anthropic-version": "2023-06-01", "anthropic-beta": "x"}
    return httpx.post(f"{base_url}{path}", json=body, headers=headers)


LOST_RESULT = [
    {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "toolu_x", "content": "sunny"},
            {"type": "text", "text": "hi"},
        ],
    }
]
ASKED = {"model": "tiny", "max_tokens": 4, "messages": HELLO}


@pytest.mark.parametrize(
    "body, status, kind, says",
    [
        ({"model": "tiny", "messages": HELLO}, 400, "invalid_request_error", "max_tokens: Field"),
        ({**ASKED, "messages": LOST_RESULT}, 400, "invalid_request_error", "'toolu_x' answers no"),
        (
            {**ASKED, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "time"}},
            400,
            "invalid_request_error",
            "tool_choice: no tool named 'time'",
        ),
        ({**ASKED, "temperature": 1.5}, 400, "invalid_request_error", "temperature:"),
        ({**ASKED, "model": "huge"}, 404, "not_found_error", "unknown model 'huge'"),
        (
            {**ASKED, "stream": True, "mlxspec": {"proposer": "oracle"}},
            400,
            "invalid_request_error",
            "unknown proposer 'oracle'",
        ),
    ],
)
def test_bad_requests_get_anthropics_error_shape(base_url, body, status, kind, says):
    response = raw_post(base_url, body)
    assert response.status_code == status, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == kind
    assert says in error["error"]["message"]
    assert_serving(base_url)
    assert raw_post(base_url, {**ASKED, "max_tokens": 2}).is_success


def test_the_sdk_raises_the_errors_it_knows(client):
    with pytest.raises(anthropic.BadRequestError) as refused:
        ask(client, tools=[WEATHER], tool_choice={"type": "tool", "name": "time"})
    assert "no tool named 'time'" in refused.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="huge", messages=HELLO)


def test_count_tokens_needs_the_model_in_memory(base_url):
    """The loop counts with the resident model's tokenizer; loading is the worker's job."""
    body = {"model": "tiny-b", "messages": HELLO}
    response = raw_post(base_url, body, "/v1/messages/count_tokens")
    assert response.status_code == 503
    assert response.json()["error"]["type"] == "overloaded_error"
    assert "tiny-b is not loaded" in response.json()["error"]["message"]
    assert_serving(base_url)


# --- Tools and reasoning, from models rigged to write them (scripted.py) ----------------

GET_WEATHER = {**WEATHER, "name": "get_weather"}
CITIES = [{"role": "user", "content": "Weather in Paris and Rome?"}]


@pytest.fixture(scope="module", params=[1, 4], ids=["one-at-a-time", "batched"])
def scripted(request) -> Iterator[anthropic.Anthropic]:
    limits = ServerLimits(max_batch=request.param)
    with serving(ScriptedProvider(), limits=limits, preload="qwen3-calls") as url:
        yield anthropic.Anthropic(base_url=url, api_key="-", max_retries=0, timeout=60)


def tool_for_template(tool: dict) -> dict:
    parameters = tool["input_schema"]
    function = {"name": tool["name"], "description": tool["description"], "parameters": parameters}
    return {"type": "function", "function": function}


def test_a_thinking_model_calls_tools_in_content_blocks(scripted):
    answer = scripted.messages.create(
        model="qwen3-calls", max_tokens=64, messages=CITIES, tools=[GET_WEATHER]
    )
    plain = plain_answer("qwen3-calls", CITIES, [tool_for_template(GET_WEATHER)])
    assert [block.type for block in answer.content] == ["thinking", "tool_use", "tool_use"]
    assert answer.content[0].thinking == plain.reasoning == "\nThe user asks for two cities.\n"
    calls = [(block.name, block.input) for block in answer.content[1:]]
    assert calls == [(c.name, json.loads(c.arguments)) for c in plain.tool_calls]
    assert calls == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    assert all(block.id.startswith("toolu_") for block in answer.content[1:])
    assert answer.stop_reason == "tool_use"
    with scripted.messages.stream(
        model="qwen3-calls", max_tokens=64, messages=CITIES, tools=[GET_WEATHER]
    ) as stream:
        final = stream.get_final_message()
    assert [block.type for block in final.content] == ["thinking", "tool_use", "tool_use"]
    assert final.content[0].thinking == answer.content[0].thinking
    assert [(block.name, block.input) for block in final.content[1:]] == calls
    assert final.stop_reason == "tool_use"
    assert final.usage.output_tokens == answer.usage.output_tokens
    given = [u.input_tokens + u.cache_read_input_tokens for u in (final.usage, answer.usage)]
    assert given[0] == given[1]
    assert final.usage.cache_read_input_tokens > 0  # the same prompt again: from the cache


def test_a_tool_result_is_answered(scripted):
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Ask.", "signature": ""},
                {
                    "type": "tool_use",
                    "id": "toolu_7",
                    "name": "get_weather",
                    "input": {"city": "P"},
                },
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_7", "content": "18C, sunny"}],
        },
    ]
    answer = scripted.messages.create(
        model="qwen3-answers", max_tokens=64, messages=history, tools=[GET_WEATHER]
    )
    assert [block.type for block in answer.content] == ["thinking", "text"]
    assert answer.content[1].text == "It is 18C and sunny." and answer.stop_reason == "end_turn"


def test_count_tokens_counts_tools_and_the_thinking_switch(scripted):
    def count(**extra) -> int:
        return scripted.messages.count_tokens(model="qwen3-calls", messages=CITIES, **extra)

    # Counted with the model in memory: a message loads it.
    scripted.messages.create(model="qwen3-calls", max_tokens=1, messages=CITIES)
    bare = count().input_tokens
    assert count(tools=[GET_WEATHER]).input_tokens > bare
    # Qwen3's template closes an empty think block when thinking is off.
    assert count(thinking={"type": "disabled"}).input_tokens > bare
    assert count(tools=[GET_WEATHER], tool_choice={"type": "none"}).input_tokens == bare


def test_count_tokens_renders_with_the_models_template_defaults():
    """A model whose registry entry turns thinking off by default (`chat_template_kwargs`):
    count_tokens counts the prompt the message is given, as its usage reports it."""
    provider = ScriptedProvider(template_kwargs={"enable_thinking": False})
    with serving(provider, preload="qwen3-calls") as url:
        client = anthropic.Anthropic(base_url=url, api_key="-", max_retries=0, timeout=60)
        answer = client.messages.create(model="qwen3-calls", max_tokens=1, messages=CITIES)
        given = answer.usage.input_tokens + (answer.usage.cache_read_input_tokens or 0)
        counted = client.messages.count_tokens(model="qwen3-calls", messages=CITIES)
        thinking = {"type": "enabled", "budget_tokens": 1024}
        with_thinking = client.messages.count_tokens(
            model="qwen3-calls", messages=CITIES, thinking=thinking
        )
    assert counted.input_tokens == given
    assert with_thinking.input_tokens != given  # the default changes the prompt


def test_sampling_settings_reach_the_engine(client):
    """Recent SDKs have no temperature, top_p or top_k arguments: they go in extra_body."""
    sampling = {"temperature": 0.5, "top_p": 0.9, "top_k": 5}
    answer = ask(client, max_tokens=2, extra_body=sampling)
    assert {key: answer.x_mlxspec["sampling"][key] for key in sampling} == sampling


class Relayed:
    """An `Answering` stand-in: the outputs it was given, then released."""

    def __init__(self, *outputs):
        self.outputs, self.released = outputs, False

    async def waiting(self):
        return
        yield

    async def __aiter__(self):
        for output in self.outputs:
            yield output

    def release(self) -> None:
        self.released = True


def test_the_parts_the_end_releases_are_streamed_before_the_stop():
    """The parser holds back text that may begin a marker until the answer ends (Answered)."""
    record = finished()
    done = Done(record, "Hi <", (1, 2))
    relayed = Relayed(
        PartsOf(Bonus((1,), "Hi"), (AnswerText("Hi"),)),
        Answered(done, ParsedAnswer("", "Hi <"), (AnswerText(" <"),)),
    )

    async def collect() -> list[str]:
        return [event async for event in _events(relayed, MessageStream("msg_1", "tiny", 7))]

    sse = "".join(asyncio.run(collect()))
    deltas = [json.loads(line[6:]) for line in sse.splitlines() if '"content_block_delta"' in line]
    assert "".join(delta["delta"]["text"] for delta in deltas) == "Hi <"
    assert event_names(sse.encode())[-2:] == ["message_delta", "message_stop"]
    assert relayed.released


def test_a_thinking_block_opens_with_the_empty_signature_the_client_expects():
    """Anthropic's thinking blocks carry a `signature` (clients send it back); ours is
    empty, but there from the block's start."""
    stream = MessageStream("msg_1", "tiny", 7)
    events = stream.part(ReasoningText("Hm.")) + stream.part(AnswerText("Hi"))
    starts = [
        json.loads(line[6:])["content_block"]
        for chunk in events
        for line in chunk.splitlines()
        if line.startswith("data: ") and '"content_block_start"' in line
    ]
    assert starts == [
        {"type": "thinking", "thinking": "", "signature": ""},
        {"type": "text", "text": ""},
    ]


@pytest.mark.parametrize(
    "arguments, tool_input",
    [
        ("{}", {}),
        ("", {}),
        ('{"city": "Paris"}', {"city": "Paris"}),
        ("[1]", {"_arguments": "[1]"}),
    ],
)
def test_a_calls_arguments_become_its_input_object(arguments, tool_input):
    """An empty object stays empty; only text that is not a JSON object is kept apart."""
    answer = ParsedAnswer("", "", (ToolCall("toolu_1", "weather", arguments),))
    (block,) = message("msg_1", "tiny", answer, finished())["content"]
    assert block["type"] == "tool_use" and block["id"].startswith("toolu_")
    assert block["name"] == "weather" and block["input"] == tool_input
