"""Every schema of the JSON-Schema-Test-Suite (the first of each keyword's file, drafts 2020-12
and 7), asked for as OpenAI's `response_format`, the Responses API's `text.format`,
Anthropic's `output_config.format` and a forced tool's parameters, on a tiny random model:
an answer the schema accepts, or a 4xx naming what cannot be enforced; never a 5xx, never a
finished answer the schema rejects (tests/schema_suite.py judges). Then schemas built so
that the one answer the grammar allows breaks a keyword it would ignore: refused."""

from __future__ import annotations

from collections import Counter

import httpx
import pytest
import schema_suite
from schema_suite import ENFORCED, FORMS, REFUSED, SCHEMAS
from test_server import TinyProvider, serving

from mlxspec.structured.unenforced import exclusive_one_of

MAX_TOKENS = 200  # a forced call's markup and `{"value": ...}` in byte tokens, with room


@pytest.fixture(scope="module")
def client():
    with serving(TinyProvider(max_tokens=MAX_TOKENS)) as url:
        with httpx.Client(base_url=url, timeout=120) as client:
            yield client


@pytest.mark.parametrize("form", FORMS)
def test_each_schema_is_enforced_or_refused_by_name(client, form):
    outcomes = {name: schema_suite.run(client, name, form, "tiny", MAX_TOKENS) for name in SCHEMAS}
    wrong = {name: o for name, o in outcomes.items() if o.kind not in (ENFORCED, REFUSED)}
    assert not {n: o for n, o in wrong.items() if o.kind != schema_suite.CUT}, wrong
    kinds = Counter(outcome.kind for outcome in outcomes.values())
    assert kinds[ENFORCED] >= len(SCHEMAS) // 2, kinds  # most are answered, and checked
    for name, outcome in outcomes.items():
        if outcome.kind == REFUSED:  # one line quoting the keyword (or what else is wrong)
            named = any(mark in outcome.detail for mark in ('"', "'", "valid dictionary"))
            assert "\n" not in outcome.detail and named, (name, outcome)
    # the keywords the grammar cannot enforce are named, not ignored
    for name in ("draft2020-12/dependentRequired", "draft2020-12/not", "draft7/uniqueItems"):
        keyword = name.split("/")[1]
        assert outcomes[name].kind == REFUSED and f'"{keyword}"' in outcomes[name].detail


# Schemas whose grammar, were the keyword ignored, would allow only answers that break it.
BROKEN_IF_IGNORED = {
    "dependentRequired": {
        "type": "object",
        "properties": {"bar": {"const": 1}},
        "required": ["bar"],
        "additionalProperties": False,
        "dependentRequired": {"bar": ["foo"]},
    },
    "not": {
        "type": "object",
        "properties": {"a": {"not": {"const": None}, "type": "null"}},
        "required": ["a"],
    },
    "uniqueItems": {
        "type": "object",
        "properties": {
            "a": {"type": "array", "items": {"const": 1}, "minItems": 2, "uniqueItems": True}
        },
        "required": ["a"],
    },
    "oneOf": {
        "type": "object",
        "properties": {"a": {"oneOf": [{"type": "integer"}, {"const": 1}], "enum": [1]}},
        "required": ["a"],
    },
}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("keyword", list(BROKEN_IF_IGNORED))
def test_a_keyword_the_grammar_would_ignore_is_refused(client, form, keyword):
    route, body = schema_suite.request(form, BROKEN_IF_IGNORED[keyword], "tiny", MAX_TOKENS)
    response = client.post(route, json=body)
    assert response.status_code == 400, response.text
    assert f'"{keyword}"' in response.json()["error"]["message"]


def test_a_one_of_whose_branches_exclude_each_other_is_an_any_of():
    """What agents send (Qwen Code's `fork_turns`): enforced, since at most one branch can
    match; branches that may overlap stay `oneOf`, for the server to refuse."""
    fork_turns = {"oneOf": [{"type": "string", "enum": ["all"]}, {"pattern": "^[1-9][0-9]*$"}]}
    by_type = {"oneOf": [{"type": "string"}, {"type": "array"}, {"$ref": "#/$defs/n"}]}
    by_type["$defs"] = {"n": {"type": "null"}}
    tagged = {
        "oneOf": [
            {"type": "object", "properties": {"k": {"const": "a"}}, "required": ["k"]},
            {"type": "object", "properties": {"k": {"const": "b"}}, "required": ["k"]},
        ]
    }
    for schema in (fork_turns, by_type, tagged):
        assert "anyOf" in exclusive_one_of(schema) and "oneOf" not in exclusive_one_of(schema)
    overlapping = [
        {"oneOf": [{"type": "integer"}, {"minimum": 2}]},
        {"oneOf": [{"type": "number"}, {"type": "integer"}]},
        {"oneOf": [{"type": "object"}, {"type": "object", "required": ["k"]}]},
        {"oneOf": [{"enum": ["a", "1"]}, {"pattern": "^[1-9]$"}]},
    ]
    for schema in overlapping:
        assert exclusive_one_of(schema) == schema
    # keywords of the wrong kind (a client's mistake) leave it as it is: the compiler's 400
    malformed = [
        {"oneOf": [{"enum": ["a"]}, {"maxLength": "2"}]},
        {"oneOf": [{"type": "object", "properties": [1], "required": 3}] * 2},
        {"oneOf": [{"enum": ["a"]}, {"pattern": "("}]},
    ]
    for schema in malformed:
        assert exclusive_one_of(schema) == schema
    deep: dict = {}
    for _ in range(5000):
        deep = {"items": deep}
    assert exclusive_one_of(deep) is deep


def test_a_malformed_one_of_is_a_400_not_a_500(client):
    schema = {
        "type": "object",
        "properties": {"a": {"oneOf": [{"enum": ["a"]}, {"maxLength": "2"}]}},
    }
    for form in FORMS:
        route, body = schema_suite.request(form, schema, "tiny", MAX_TOKENS)
        response = client.post(route, json=body)
        assert 400 <= response.status_code < 500, (form, response.text)
