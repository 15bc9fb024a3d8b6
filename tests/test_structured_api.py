"""Structured output through `serve`, with the official `openai` and `anthropic` clients:
`response_format` (a JSON schema, on chat and text completions) and forced tool calls
(OpenAI's "required" and named function, Anthropic's "any" and "tool") on a tiny random
model, whose answers the grammar alone makes valid. A schema answer is constrained plain
decoding's (k=0); what cannot be enforced is a 400 in the route's dialect."""

from __future__ import annotations

import json
import threading
import time

import anthropic
import httpx
import openai
import pytest
from test_server import CHAT, HELLO, TinyProvider, serving, tiny_engine

import mlxspec.server.generations
import mlxspec.server.request_body
from mlxspec.decoding.engine import GenerationSettings
from mlxspec.events import Done
from mlxspec.structured.grammar import Grammar

# Bounded strings and numbers: a random model's answer ends within a few dozen tokens.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "pet": {"enum": ["cat", "dog"]},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}
CITY = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "maximum": 9}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
ZONE = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": ZONE}}
MAX_TOKENS = 120  # byte tokens: a call with its markup is about 90


def valid_person(value: object) -> bool:
    return (
        isinstance(value, dict)
        and set(value) == {"name", "age", "pet"}
        and isinstance(value["name"], str)
        and len(value["name"]) <= 6
        and type(value["age"]) is int
        and 0 <= value["age"] <= 99
        and value["pet"] in ("cat", "dog")
    )


def valid_city(value: object) -> bool:
    return (
        isinstance(value, dict)
        and set(value) == {"city", "days"}
        and value["city"] in ("Paris", "Rome")
        and type(value["days"]) is int
        and value["days"] <= 9
    )


@pytest.fixture(scope="module")
def base_url():
    with serving(TinyProvider(max_tokens=MAX_TOKENS)) as url:
        yield url


@pytest.fixture()
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="-", max_retries=0, timeout=60)


def constrained_plain(prompt, schema: dict) -> Done:
    """Plain decoding (k=0, no proposer) under the schema's grammar."""
    settings = GenerationSettings(max_tokens=MAX_TOKENS, grammar=Grammar.json_schema(schema))
    events = tiny_engine("tiny").stream(prompt, settings, "none")
    return next(event for event in events if isinstance(event, Done))


def schema_format(schema: dict, strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "p", "schema": schema, "strict": strict}}


def test_a_json_schema_answer_is_valid_and_constrained_plain_decodings(client):
    response = client.chat.completions.create(
        model="tiny", messages=HELLO, temperature=0, response_format=schema_format(PERSON)
    )
    content = response.choices[0].message.content
    assert valid_person(json.loads(content)), content
    assert response.choices[0].finish_reason == "stop"
    assert content == constrained_plain(HELLO, PERSON).text
    record = response.model_extra["x_mlxspec"]
    assert record["grammar"] == "json_schema" and record["grammar_drafted"] > 0


def test_a_text_completion_takes_a_response_format_too(client):
    response = client.completions.create(
        model="tiny",
        prompt="one two",
        temperature=0,
        max_tokens=MAX_TOKENS,
        extra_body={"response_format": schema_format(PERSON)},
    )
    assert response.choices[0].text == constrained_plain("one two", PERSON).text
    assert valid_person(json.loads(response.choices[0].text))


@pytest.mark.parametrize("parallel", [{"parallel_tool_calls": False}, {}], ids=["off", "unset"])
@pytest.mark.parametrize(
    "choice, names",
    [
        ({"type": "function", "function": {"name": "get_weather"}}, {"get_weather"}),
        ("required", {"get_weather", "get_time"}),
    ],
)
def test_a_forced_tool_call_is_one_call_with_valid_arguments(client, choice, names, parallel):
    """One call, unless the request asks for more (`parallel_tool_calls: true`)."""
    response = client.chat.completions.create(
        model="tiny",
        messages=HELLO,
        temperature=0,
        tools=[WEATHER, TIME],
        tool_choice=choice,
        **parallel,
    )
    (call,) = response.choices[0].message.tool_calls
    assert call.function.name in names
    arguments = json.loads(call.function.arguments)
    assert valid_city(arguments) or arguments in ({"zone": "UTC"}, {"zone": "CET"}), arguments
    assert response.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize(
    "choice", [{"type": "tool", "name": "get_weather"}, {"type": "any"}], ids=["tool", "any"]
)
def test_anthropics_forced_tool_use_is_a_tool_use_block(base_url, choice):
    client = anthropic.Anthropic(base_url=base_url, api_key="-", max_retries=0, timeout=60)
    tool = {"name": "get_weather", "description": "The weather", "input_schema": CITY}
    message = client.messages.create(
        model="tiny",
        max_tokens=MAX_TOKENS,
        messages=HELLO,
        tools=[tool],
        tool_choice={**choice, "disable_parallel_tool_use": True},
        extra_body={"temperature": 0},
    )
    (block,) = [block for block in message.content if block.type == "tool_use"]
    assert block.name == "get_weather" and valid_city(block.input), block
    assert message.stop_reason == "tool_use"


BAD = [
    # (body, the parameter the error names, what its message says)
    (
        {"response_format": schema_format({"type": "object", "x-guidance": "lenient"})},
        "response_format.json_schema.schema.x-guidance",
        "must be an object",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": [1]}}},
        "response_format.json_schema.schema",
        "valid dictionary",
    ),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema: give it"),
    (
        {"response_format": schema_format({"type": "string", "format": "hostname2"})},
        "response_format.json_schema.schema",
        '"hostname2"; remove it, or set strict to false',
    ),
    (  # lenient or not: a keyword that asserts is never ignored
        {"response_format": schema_format({"type": "array", "uniqueItems": True}, strict=False)},
        "response_format.json_schema.schema",
        'cannot enforce the keyword(s) "uniqueItems"',
    ),
    (
        {"response_format": schema_format({"type": "strnig"}, strict=False)},
        "response_format.json_schema.schema",
        "strnig",
    ),
    (
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
        "no tool named 'nope'",
    ),
    (
        {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
        "response_format",
        "drop one of them",
    ),
]


@pytest.mark.parametrize("body, param, says", BAD)
def test_what_cannot_be_enforced_is_a_400_naming_it(base_url, body, param, says):
    response = httpx.post(f"{base_url}{CHAT}", json={"model": "tiny", "messages": HELLO, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error
    assert "\n" not in error["message"]


def test_a_lenient_schema_ignores_what_a_strict_one_refuses(client):
    schema = {
        **PERSON,
        "properties": {
            **PERSON["properties"],
            "name": {"type": "string", "maxLength": 6, "format": "hostname2"},
        },
    }
    response = client.chat.completions.create(
        model="tiny", messages=HELLO, temperature=0, response_format=schema_format(schema, False)
    )
    assert valid_person(json.loads(response.choices[0].message.content))
    with pytest.raises(openai.BadRequestError, match="hostname2"):
        client.chat.completions.create(
            model="tiny", messages=HELLO, response_format=schema_format(schema, True)
        )


def test_a_slow_schema_check_holds_up_no_other_client(base_url, monkeypatch):
    """A schema is checked off the event loop: while one takes long, another client is
    answered; past the bound, the request gets a 400 saying so."""
    started, finished = threading.Event(), threading.Event()

    def slow_problem(grammar):
        started.set()
        time.sleep(3.0)
        finished.set()
        return None

    monkeypatch.setattr(mlxspec.server.request_body, "grammar_problem", slow_problem)
    monkeypatch.setattr(mlxspec.server.generations, "COMPILE_SECONDS", 0.5)
    format_ = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    body = {"model": "tiny", "messages": HELLO, "response_format": format_}
    answer = {}
    asking = threading.Thread(
        target=lambda: answer.update(slow=httpx.post(f"{base_url}/v1/chat/completions", json=body))
    )
    asking.start()
    assert started.wait(30)
    assert httpx.get(f"{base_url}/v1/models").status_code == 200
    assert not finished.is_set(), "the other client waited for the schema check"
    asking.join()
    assert answer["slow"].status_code == 400
    assert "took over 0.5 s to check" in answer["slow"].json()["error"]["message"]
