"""OpenAI's Responses API (`/v1/responses`, Codex's wire API): the translations on their own
(Codex's recorded request included), then the real server driven by the official `openai`
client, plain and streamed, with stored conversations and with tool calls from models
rigged to make them (scripted.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from test_server import ECHO, TinyProvider, serving, tiny_engine
from test_tool_calls import ScriptedProvider, plain_answer

from mlxspec.decoding.engine import GenerationSettings
from mlxspec.events import Done, RunRecord
from mlxspec.markup.conversation import (
    AnswerText,
    ParsedAnswer,
    ReasoningText,
    ToolCall,
    ToolCallArguments,
    ToolCallStarted,
)
from mlxspec.server import ServerLimits
from mlxspec.server.errors import ApiError
from mlxspec.server.openai.schemas import ChatRequest
from mlxspec.server.responses.schemas import ResponsesRequest
from mlxspec.server.responses.store import ResponseStore
from mlxspec.server.responses.translate import (
    Envelope,
    ResponseStream,
    Tools,
    answer_constraint,
    conversation,
    flat_name,
    generation_request,
    input_items,
    output_items,
    status_of,
    tools,
)

AGENTS = Path(__file__).parent / "data" / "agents"
CODEX = json.loads((AGENTS / "codex-0.171.0.responses.json").read_text())
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def translated(**body):
    request = ResponsesRequest.model_validate({"model": "tiny", **body})
    offered = tools(request)
    return conversation(input_items(request), request.instructions, offered.for_template, {})


# --- Requests in ------------------------------------------------------------------------


def test_codexs_request_becomes_one_system_prompt_its_turns_and_its_function_tools():
    request = ResponsesRequest.model_validate(CODEX["body"])
    offered = tools(request)
    chat = conversation(input_items(request), request.instructions, offered.for_template, {})
    roles = [message["role"] for message in chat.messages]
    assert roles == ["system", "user", "user"]  # two developer messages, one system prompt
    developer = [item for item in CODEX["body"]["input"] if item["role"] == "developer"]
    for item in developer:
        assert item["content"][0]["text"] in chat.messages[0]["content"]
    assert chat.messages[-1]["content"] == "Reply with the single word: pong"
    names = [tool["function"]["name"] for tool in chat.tools]
    assert "exec_command" in names and len(names) == 12
    # the sub-agents' namespace is offered under Codex's own flat names; the hosted web
    # search runs nowhere here: dropped, named
    assert "multi_agent_v1__spawn_agent" in names and "spawn_agent" not in names
    assert offered.namespaced["multi_agent_v1__wait_agent"] == ("multi_agent_v1", "wait_agent")
    assert offered.dropped == ("web_search",)


def test_a_namespaced_tool_is_named_as_codex_joins_it():
    """Codex's ToolName::canonical_flat_name: `__` at the seam, stray underscores trimmed
    (its MCP servers' namespaces are `mcp__<server>`)."""
    assert flat_name("mcp__echo", "ping") == "mcp__echo__ping"
    assert flat_name("mcp__docs__", "_search") == "mcp__docs__search"
    assert flat_name(None, "exec_command") == "exec_command"


def test_a_namespaced_tool_may_be_forced_by_its_namespace_and_name():
    body = {"model": "tiny", "input": "Go.", "tools": codex_namespaced_tools()}
    for choice in (
        {"type": "function", "name": "spawn_agent", "namespace": "multi_agent_v1"},
        {"type": "function", "name": "multi_agent_v1__spawn_agent"},
    ):
        request = ResponsesRequest.model_validate({**body, "tool_choice": choice})
        constraint = answer_constraint(request, tools(request))
        assert constraint.tools.names == ("multi_agent_v1__spawn_agent",)


def test_a_function_call_history_becomes_a_tool_exchange():
    chat = translated(
        instructions="Be brief.",
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "Ask the tool."}],
            },
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": '{"city": "Paris"}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "18C"},
            {
                "type": "message",
                "role": "developer",
                "content": [{"type": "input_text", "text": "Answer in French."}],
            },
        ],
        tools=[WEATHER],
    )
    system, user, assistant, tool = chat.messages
    assert system == {"role": "system", "content": "Be brief.\n\nAnswer in French."}
    assert user == {"role": "user", "content": "Weather in Paris?"}
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
    }
    assert assistant == {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Ask the tool.",
        "tool_calls": [call],
    }
    assert tool == {
        "role": "tool",
        "tool_call_id": "call_1",
        "name": "get_weather",
        "content": "18C",
    }
    assert chat.tools[0]["function"]["parameters"] == WEATHER["parameters"]


@pytest.mark.parametrize(
    "body, param",
    [
        (
            {"input": [{"type": "function_call_output", "call_id": "c9", "output": "x"}]},
            "input[0].call_id",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0]",
        ),
        (
            {
                "input": [
                    {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "[1]"}
                ]
            },
            "input[0].arguments",
        ),
    ],
)
def test_what_cannot_be_translated_is_a_400_naming_the_item(body, param):
    with pytest.raises(ApiError) as refused:
        translated(**body)
    assert refused.value.status_code == 400 and refused.value.param == param


def test_a_forced_call_is_one_call_unless_parallel_calls_are_asked_for():
    named = {"type": "function", "name": "get_weather"}

    def forced(**extra):
        body = {"input": "x", "tools": [WEATHER], "tool_choice": named, **extra}
        request = ResponsesRequest.model_validate(body)
        return answer_constraint(request, tools(request)).tools

    assert forced().names == ("get_weather",) and forced().parallel is False
    assert forced(parallel_tool_calls=True).parallel is True
    with pytest.raises(ApiError):
        forced(tool_choice={"type": "function", "name": "nope"})


def test_chats_forced_call_is_one_call_unless_parallel_calls_are_asked_for():
    """SmolLM2, forced to get_weather, made the same call twice and began a third."""
    chat_tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}

    def forced(**extra):
        body = {"messages": [{"role": "user", "content": "x"}], "tools": [chat_tool], **extra}
        return ChatRequest.model_validate(body).answer_constraint().tools

    named = {"type": "function", "function": {"name": "get_weather"}}
    assert forced(tool_choice=named).parallel is False
    assert forced(tool_choice="required").parallel is False
    assert forced(tool_choice=named, parallel_tool_calls=False).parallel is False
    assert forced(tool_choice=named, parallel_tool_calls=True).parallel is True


# --- Answers out, read back by the official client ---------------------------------------


def finished(reason: str = "stop") -> RunRecord:
    record = RunRecord(model="tiny", proposer="none", speculative=False, sampling={})
    record.prompt_tokens, record.completion_tokens, record.finish_reason = 7, 5, reason
    return record


def test_output_items_are_reasoning_text_then_calls():
    answer = ParsedAnswer("hmm", "Sunny.", (ToolCall("call_0", "get_weather", '{"city": "P"}'),))
    items = output_items(answer, Tools(None))
    assert [item["type"] for item in items] == ["reasoning", "message", "function_call"]
    assert items[0]["content"][0]["text"] == "hmm"
    assert items[1]["content"][0]["text"] == "Sunny."
    assert items[2]["call_id"] == "call_0" and items[2]["arguments"] == '{"city": "P"}'


def test_the_stream_numbers_its_events_and_ends_with_the_whole_response():
    body = ResponsesRequest.model_validate({"model": "tiny", "input": "hi"})
    stream = ResponseStream(Envelope("resp_1", "tiny", body))
    parts = [
        ReasoningText("Think."),
        AnswerText("It is"),
        AnswerText(" sunny."),
        ToolCallStarted(0, "call_0", "get_weather"),
        ToolCallArguments(0, '{"city": '),
        ToolCallArguments(0, '"P"}'),
    ]
    events = [*stream.opening()]
    for part in parts:
        events += stream.part(part)
    events += stream.closing(finished(), ParsedAnswer("Think.", "It is sunny."))
    payloads = [json.loads(event.split("data: ", 1)[1]) for event in events]
    assert [p["sequence_number"] for p in payloads] == list(range(len(payloads)))
    kinds = [p["type"] for p in payloads]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert (
        kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 3
    )
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    final = payloads[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][1]["content"][0]["text"] == "It is sunny."
    assert final["output"][2]["arguments"] == '{"city": "P"}'
    assert final["usage"]["input_tokens"] == 7 and final["status"] == "completed"


def test_the_store_is_bounded_and_forgets_the_least_recently_used():
    store = ResponseStore(max_responses=2)
    for name in "abc":
        store.put(
            {"id": name, "output": []}, [{"type": "message", "role": "user", "content": name}]
        )
    assert store.get("a") is None and store.get("b") is not None and len(store) == 2
    store.put({"id": "d", "output": []}, [])  # b was read last: c goes
    assert store.get("c") is None and store.get("b") is not None
    small = ResponseStore(max_bytes=200)
    small.put({"id": "x", "output": []}, [{"content": "y" * 300}])
    assert small.get("x") is None and small.bytes == 0


# --- The real server ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    with serving(TinyProvider(), preload="tiny") as url:
        yield url


@pytest.fixture()
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="-", max_retries=0, timeout=60)


def plain_decoding(messages: list[dict], max_tokens: int) -> Done:
    events = tiny_engine("tiny").stream(messages, GenerationSettings(max_tokens=max_tokens), "none")
    return next(event for event in events if isinstance(event, Done))


def test_an_answer_is_plain_decodings_and_says_it_was_cut(client):
    response = client.responses.create(model="tiny", input=ECHO, max_output_tokens=24)
    plain = plain_decoding([{"role": "user", "content": ECHO}], 24)
    assert response.output_text == plain.text and response.id.startswith("resp_")
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.input_tokens == plain.record.prompt_tokens
    assert response.usage.output_tokens == len(plain.token_ids)
    assert response.model_extra["x_mlxspec"]["lossless"] is True


def test_a_streamed_answer_is_the_whole_one(client):
    whole = client.responses.create(model="tiny", input=ECHO, max_output_tokens=24)
    events = list(
        client.responses.create(model="tiny", input=ECHO, max_output_tokens=24, stream=True)
    )
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output_text == whole.output_text


def test_the_next_turn_may_name_the_last_response_instead_of_resending_it(client):
    first = client.responses.create(model="tiny", input="one two", max_output_tokens=8)
    second = client.responses.create(
        model="tiny", input="three", previous_response_id=first.id, max_output_tokens=8
    )
    resent = client.responses.create(
        model="tiny",
        input=[
            {"role": "user", "content": "one two"},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "three"},
        ],
        max_output_tokens=8,
        store=False,
    )
    assert second.output_text == resent.output_text
    assert second.usage.input_tokens == resent.usage.input_tokens
    assert second.previous_response_id == first.id
    # store: false kept nothing to continue from
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model="tiny", input="four", previous_response_id=resent.id)
    assert missing.value.body["code"] == "previous_response_not_found"
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_codexs_own_request_too_long_for_the_model_is_one_clear_error(base_url):
    """Codex's recorded first request (40 KB) is far over a tiny model's context: OpenAI's
    context_length_exceeded, with the numbers, before any prefill."""
    body = {**CODEX["body"], "model": "tiny"}
    refused = httpx.post(f"{base_url}/v1/responses", json=body, timeout=30)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert "1024" in error["message"] and refused.elapsed.total_seconds() < 5


def test_codexs_request_slimmed_to_fit_is_answered_in_the_stream_codex_reads(base_url):
    body = json.loads(json.dumps(CODEX["body"]))
    body["model"] = "tiny"
    body["input"] = [item for item in body["input"] if item["role"] == "user"][-1:]
    # one short function and the hosted web search (a byte-level tokenizer: 1,024 bytes)
    body["tools"] = [
        t for t in body["tools"] if t.get("name") == "get_goal" or t["type"] == "web_search"
    ]
    with httpx.stream("POST", f"{base_url}/v1/responses", json=body, timeout=60) as streamed:
        assert streamed.status_code == 200
        assert streamed.headers["x-mlxspec-dropped-tools"] == "web_search"
        lines = [line for line in streamed.iter_lines() if line.startswith("data: ")]
    kinds = [json.loads(line[6:])["type"] for line in lines]
    assert kinds[0] == "response.created" and kinds[-1] in (
        "response.completed",
        "response.incomplete",
    )
    assert "response.output_item.done" in kinds


# --- Tool calls, from models rigged to make them -------------------------------------------


@pytest.fixture(scope="module", params=[1, 4], ids=["one-at-a-time", "batched"])
def scripted(request) -> Iterator[openai.OpenAI]:
    limits = ServerLimits(max_batch=request.param)
    with serving(ScriptedProvider(), limits=limits, preload="qwen3-calls") as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=60)


CITIES = "Weather in Paris and Rome?"


def test_calls_come_back_as_function_call_items_plain_and_streamed(scripted):
    response = scripted.responses.create(
        model="qwen3-calls", input=CITIES, tools=[WEATHER], max_output_tokens=64
    )
    chat_tool = {
        "type": "function",
        "function": {k: WEATHER[k] for k in ("name", "description", "parameters")},
    }
    plain = plain_answer("qwen3-calls", [{"role": "user", "content": CITIES}], [chat_tool])
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "function_call", "function_call"]
    assert response.output[0].content[0].text == plain.reasoning
    calls = [(item.name, json.loads(item.arguments)) for item in response.output[1:]]
    assert calls == [(c.name, json.loads(c.arguments)) for c in plain.tool_calls]
    assert response.status == "completed"
    events = list(
        scripted.responses.create(
            model="qwen3-calls", input=CITIES, tools=[WEATHER], max_output_tokens=64, stream=True
        )
    )
    final = events[-1].response
    assert [item.type for item in final.output] == kinds
    assert [(i.name, json.loads(i.arguments)) for i in final.output[1:]] == calls
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [json.loads(e.arguments) for e in done] == [c[1] for c in calls]


def undescribed(value):
    if isinstance(value, dict):
        return {k: undescribed(v) for k, v in value.items() if k != "description"}
    return [undescribed(item) for item in value] if isinstance(value, list) else value


def codex_namespaced_tools() -> list[dict]:
    """From Codex's recorded request: its sub-agents' namespace (two of its tools, without
    descriptions, for a byte-level tokenizer's context), and web search."""
    (namespace,) = [tool for tool in CODEX["body"]["tools"] if tool["type"] == "namespace"]
    kept = [t for t in namespace["tools"] if t["name"] in ("spawn_agent", "wait_agent")]
    return [{**undescribed(namespace), "tools": undescribed(kept)}, {"type": "web_search"}]


def test_a_call_to_a_namespaced_tool_comes_back_with_its_namespace(scripted):
    """Codex reads a call to one of a namespace's tools (its sub-agents, its MCP servers')
    as a function_call with the bare name and the namespace, plain and streamed; the call
    goes back in the next turn's input as it came, and reaches the model by its flat name."""
    asked = dict(model="qwen3-spawns", input="Count the files.", max_output_tokens=64)
    response = scripted.responses.create(**asked, tools=codex_namespaced_tools())
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert (call.name, call.to_dict()["namespace"]) == ("spawn_agent", "multi_agent_v1")
    assert json.loads(call.arguments) == {"message": "Count."}
    events = list(scripted.responses.create(**asked, tools=codex_namespaced_tools(), stream=True))
    added = [e.item for e in events if e.type == "response.output_item.added"]
    final = [item for item in events[-1].response.output if item.type == "function_call"]
    for item in [*[i for i in added if i.type == "function_call"], *final]:
        assert (item.name, item.to_dict()["namespace"]) == ("spawn_agent", "multi_agent_v1")
    history = [
        {"role": "user", "content": "Count the files."},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "3 files"},
    ]
    request = ResponsesRequest.model_validate(
        {"model": "qwen3-answers", "input": history, "tools": codex_namespaced_tools()}
    )
    chat = conversation(input_items(request), None, tools(request).for_template, {})
    turn = chat.messages[1]["tool_calls"][0]["function"]
    assert turn["name"] == "multi_agent_v1__spawn_agent"
    assert chat.messages[2]["name"] == "multi_agent_v1__spawn_agent"


def test_a_function_calls_output_is_answered(scripted):
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "type": "function_call",
            "call_id": "call_7",
            "name": "get_weather",
            "arguments": '{"city": "P"}',
        },
        {"type": "function_call_output", "call_id": "call_7", "output": "18C, sunny"},
    ]
    response = scripted.responses.create(
        model="qwen3-answers", input=history, tools=[WEATHER], max_output_tokens=64
    )
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output_text == "It is 18C and sunny." and response.status == "completed"


def stream_payloads(stream: ResponseStream, parts) -> list[dict]:
    events = [event for part in parts for event in stream.part(part)]
    return [json.loads(event.split("data: ", 1)[1]) for event in events]


def test_a_message_item_opens_empty_and_is_done_with_its_text():
    """Codex and the SDK gather a message's text from its deltas: the item added at its
    start holds no content yet (the done one holds it whole)."""
    body = ResponsesRequest.model_validate({"model": "tiny", "input": "hi"})
    stream = ResponseStream(Envelope("resp_1", "tiny", body))
    payloads = stream_payloads(stream, [AnswerText("It is"), ToolCallStarted(0, "c", "f")])
    added = [p["item"] for p in payloads if p["type"] == "response.output_item.added"]
    done = [p["item"] for p in payloads if p["type"] == "response.output_item.done"]
    assert added[0]["type"] == "message" and added[0]["content"] == []
    assert added[0]["status"] == "in_progress"
    assert done[0]["content"][0]["text"] == "It is" and done[0]["status"] == "completed"


def test_arguments_with_no_call_open_are_not_a_calls_delta():
    body = ResponsesRequest.model_validate({"model": "tiny", "input": "hi"})
    stream = ResponseStream(Envelope("resp_1", "tiny", body))
    payloads = stream_payloads(stream, [AnswerText("Hi"), ToolCallArguments(0, '{"a": 1}')])
    assert "response.function_call_arguments.delta" not in [p["type"] for p in payloads]


def test_an_answer_cut_at_its_limit_is_incomplete_unless_it_called_tools():
    call = (ToolCall("call_0", "get_weather", "{}"),)
    assert status_of(finished("length"), ParsedAnswer("", "It is")) == "incomplete"
    assert status_of(finished("length"), ParsedAnswer("", "", call)) == "completed"
    assert status_of(finished("stop"), ParsedAnswer("", "It is")) == "completed"


def test_a_response_the_size_of_the_whole_store_is_kept():
    response, items = {"id": "x", "output": []}, [{"content": "y" * 100}]
    size = len(json.dumps(items)) + len(json.dumps(response))
    exact = ResponseStore(max_bytes=size)
    exact.put(response, items)
    assert exact.get("x") is not None and exact.bytes == size


def test_a_max_output_tokens_over_the_limit_is_granted_the_limit():
    """As its docstring promises, the translation clamps (the settings clamp again, so
    the served answer does not show it; this does)."""
    asked = {"model": "tiny", "input": "hi"}
    over = ResponsesRequest.model_validate({**asked, "max_output_tokens": 99_999})
    under = ResponsesRequest.model_validate({**asked, "max_output_tokens": 16})
    assert generation_request(over, 4096).max_tokens == 4096
    assert generation_request(under, 4096).max_tokens == 16
    assert generation_request(ResponsesRequest.model_validate(asked), 4096).max_tokens is None
