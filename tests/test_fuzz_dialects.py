"""Fuzzed requests that reach the grammar compiler and the tokenizer, in every dialect.

test_server's schemathesis fuzz builds bodies from the OpenAPI schema: a random model name
or message shape is refused before anything compiles or tokenizes. Here the bodies are
valid in shape and wild in what matters: text with lone UTF-16 surrogates and any other
character, and JSON schemas (well-formed or not: unknown types, bad regexes, `$ref`s to
nowhere, keywords with the wrong kind of value) as a forced tool's parameters and as the
answer's format. Served by the batched worker (serve's default) on a tiny llama with a
real (byte-level, Rust) tokenizer: no 5xx, no stream ending in the server's own error, and
every refusal a JSON error in its dialect's shape.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_server import TinyProvider, serving

from mlxspec.server import ServerLimits

SERVER_FAULT = "the server log has the details"  # what every internal error says

# Any character, lone surrogates (which no UTF-8 holds) among them.
TEXT = st.lists(
    st.one_of(st.characters(), st.integers(0xD800, 0xDFFF).map(chr)), min_size=1, max_size=12
).map("".join)
JSON_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.text(max_size=3))
KEYWORDS = {
    "type": st.sampled_from(["string", "integer", "object", "array", "null", "strnig", 3]),
    "enum": st.lists(JSON_VALUES, max_size=3),
    "const": JSON_VALUES,
    "pattern": st.sampled_from(["^a+$", "(", "[a-z]{2}", "\\d"]),
    "minLength": st.integers(-1, 4),
    "maxLength": st.one_of(st.integers(0, 4), st.just("x")),
    "minimum": st.integers(-3, 3),
    "format": st.sampled_from(["date", "email", "uuid", "bogus"]),
    "$ref": st.sampled_from(["#/$defs/x", "#/nowhere", "http://example.com/s"]),
}  # fmt: skip
LEAF = st.fixed_dictionaries({}, optional=KEYWORDS)


def compound(inner):
    not_schemas = st.sampled_from(["string", 1, None, []])
    return st.fixed_dictionaries(
        {},
        optional={
            "type": st.just("object"),
            "properties": st.dictionaries(
                st.text(max_size=3), st.one_of(inner, not_schemas), max_size=3
            ),
            "required": st.lists(st.text(max_size=3), max_size=2),
            "items": inner,
            "prefixItems": st.lists(inner, max_size=2),
            "anyOf": st.lists(inner, max_size=2),
            "oneOf": st.lists(inner, max_size=2),
            "allOf": st.lists(inner, max_size=2),
            "additionalProperties": st.one_of(st.booleans(), inner),
            "dependentRequired": st.dictionaries(
                st.text(max_size=2), st.lists(st.text(max_size=2))
            ),
            "$defs": st.dictionaries(st.just("x"), inner, max_size=1),
        },
    )


SCHEMAS = st.recursive(LEAF, compound, max_leaves=6)


def chat(text, schema, forced, stream):
    body = {"model": "tiny", "max_tokens": 3, "stream": stream}
    body["messages"] = [{"role": "user", "content": text}]
    if forced:
        body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
        body["tool_choice"] = {"type": "function", "function": {"name": "f"}}
    else:
        format = {"name": "x", "schema": schema}
        body["response_format"] = {"type": "json_schema", "json_schema": format}
    return "/v1/chat/completions", body


def responses(text, schema, forced, stream):
    body = {"model": "tiny", "max_output_tokens": 3, "stream": stream, "input": text}
    if forced:
        body["tools"] = [{"type": "function", "name": "f", "parameters": schema}]
        body["tool_choice"] = {"type": "function", "name": "f"}
    else:
        body["text"] = {"format": {"type": "json_schema", "name": "x", "schema": schema}}
    return "/v1/responses", body


def messages(text, schema, forced, stream):
    body = {"model": "tiny", "max_tokens": 3, "stream": stream}
    body["messages"] = [{"role": "user", "content": text}]
    body["tools"] = [{"name": "f", "input_schema": schema}]
    if forced:
        body["tool_choice"] = {"type": "tool", "name": "f"}
    return "/v1/messages", body


def text_completion(text, schema, forced, stream):
    body = {"model": "tiny", "max_tokens": 3, "stream": stream, "prompt": text}
    body["response_format"] = {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": schema},
    }
    return "/v1/completions", body


DIALECTS = {"chat": chat, "responses": responses, "messages": messages, "text": text_completion}


@pytest.fixture(scope="module")
def base_url():
    with serving(TinyProvider(max_tokens=3), limits=ServerLimits(max_batch=4)) as url:
        yield url


@pytest.mark.parametrize("dialect", DIALECTS)
def test_fuzzed_text_and_schemas_never_get_a_5xx(base_url, dialect):
    seen: set[int] = set()

    @given(text=TEXT, schema=SCHEMAS, forced=st.booleans(), stream=st.booleans())
    @settings(
        max_examples=25, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    def check(text, schema, forced, stream):
        path, body = DIALECTS[dialect](text, schema, forced, stream)
        content = json.dumps(body)  # ASCII: a lone surrogate goes as its escape
        response = httpx.post(
            base_url + path,
            content=content,
            headers={"Content-Type": "application/json"},
            timeout=60,
        )
        seen.add(response.status_code)
        assert response.status_code < 500, (path, content, response.text)
        assert SERVER_FAULT not in response.text, (path, content, response.text)
        if response.status_code >= 400:
            assert response.json()["error"]["message"], response.text

    check()
    assert 200 in seen and any(400 <= status < 500 for status in seen), seen
