"""Tools and reasoning on `serve`'s OpenAI chat route, with the official `openai` client.

The models behind the server are tiny llamas rigged to write a chosen answer (scripted.py)
over real chat templates (templates/), so the markup is real and so is every step after the
model: the engine, the worker, the parser, the response shapes. Each answer is checked
against plain decoding of the same conversation (`Engine` with no proposer), parsed.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from scripted import scripted_model, scripted_tokenizer
from test_logprobs import assert_chat_entries, assert_plain_logprobs
from test_server import CHAT, HELLO, TinyProvider, serving, tiny_engine
from test_units import CPU_LIKE_COST
from tool_examples import ASK, CALLED, TEMPLATES, WEATHER

from mlxspec.decoding.engine import Engine, GenerationSettings
from mlxspec.events import Accepted, Done
from mlxspec.markup.chat_template import encode_chat
from mlxspec.markup.conversation import (
    AnswerText,
    Conversation,
    ParsedAnswer,
    ReasoningText,
    ToolCallArguments,
    ToolCallStarted,
)
from mlxspec.markup.output_parser import OutputParser, answer_format
from mlxspec.proposers import PromptLookup
from mlxspec.registry.models_toml import Defaults
from mlxspec.server import ModelInfo, ServerLimits
from mlxspec.server.openai.replies import Reply

HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_7",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_7", "content": "18C, sunny"},
]

# name: (template, the answer's pieces, one token each)
SCRIPTS = {
    # Qwen3 thinks, then calls two tools: the first call's markers come as tokens of their
    # own, the second call whole in one token.
    "qwen3-calls": (
        "qwen3.jinja",
        [
            "<think>",
            "\nThe user asks",
            " for two cities.\n",
            "</think>",
            "\n\n",
            "<tool_call>",
            '\n{"name": "get_weather", ',
            '"arguments": {"city": "Paris"}}\n',
            "</tool_call>",
            '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
        ],
    ),
    # Qwen3 answering from a tool's result.
    "qwen3-answers": (
        "qwen3.jinja",
        ["<think>", "\nThe tool said 18C.\n", "</think>", "\n\n", "It is 18C", " and sunny."],
    ),
    # Qwen3 writing tokens that may start a marker, held back whole: "</" in the reasoning
    # until the next token, "<t" at the answer's end until the end.
    "qwen3-holds": (
        "qwen3.jinja",
        ["<think>", "\nSay ", "</", "b>.\n", "</think>", "\n\n", "It is", "<t"],
    ),
    # Qwen3 calling a tool Codex sent inside a namespace, by the name it was offered.
    "qwen3-spawns": (
        "qwen3.jinja",
        [
            "<think>",
            "\nA sub-agent counts.\n",
            "</think>",
            "\n\n",
            "<tool_call>",
            '\n{"name": "multi_agent_v1__spawn_agent", "arguments": {"message": "Count."}}\n',
            "</tool_call>",
        ],
    ),
    # SmolLM2 knows nothing of tools: the fallback format, its markers cut across tokens.
    "smollm2-calls": (
        "smollm2.jinja",
        [
            "I will check.",
            "\n<tool",
            '_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool',
            "_call>",
        ],
    ),
}


class ScriptedRuntime:
    def __init__(self, name: str):
        template, pieces = SCRIPTS[name]
        tokenizer = scripted_tokenizer(pieces, (TEMPLATES / template).read_text())
        (newline,) = tokenizer.encode("\n")  # every prompt here ends with one
        model = scripted_model(tokenizer, pieces, newline)
        self.engine = Engine(model, tokenizer, name, [PromptLookup()], verify_cost=CPU_LIKE_COST)

    def proposer(self, name: str | None) -> str:
        return "prompt-lookup" if name is None else name


class ScriptedProvider:
    default = "qwen3-calls"

    def __init__(self, template_kwargs: dict | None = None):
        defaults = Defaults(max_tokens=64, context=2048, chat_template_kwargs=template_kwargs or {})
        self.models = {
            name: ModelInfo(name, ("prompt-lookup", "none"), defaults) for name in SCRIPTS
        }
        self.opened: dict[str, ScriptedRuntime] = {}

    def check(self, name: str, proposer: str | None) -> None:
        pass

    def open(self, name: str) -> ScriptedRuntime:
        self.opened[name] = self.opened.get(name) or ScriptedRuntime(name)
        return self.opened[name]


@pytest.fixture(scope="module")
def provider() -> ScriptedProvider:
    return ScriptedProvider()


@pytest.fixture(scope="module", params=[1, 4], ids=["one-at-a-time", "batched"])
def base_url(request, provider):
    with serving(provider, limits=ServerLimits(max_batch=request.param)) as url:
        yield url


@pytest.fixture()
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="-", max_retries=0, timeout=60)


def create(client, model: str, messages=ASK, tools=(WEATHER,), **extra):
    return client.chat.completions.create(
        model=model,
        messages=messages,
        tools=list(tools) or openai.NOT_GIVEN,
        temperature=0,
        **extra,
    )


def plain_answer(model: str, messages, tools=(WEATHER,)) -> ParsedAnswer:
    """Plain decoding of the conversation (no proposer), parsed."""
    conversation = Conversation(_for_template(messages), list(tools) or None)
    engine = ScriptedRuntime(model).engine
    events = engine.stream(conversation, GenerationSettings(max_tokens=64), "none")
    done = next(event for event in events if isinstance(event, Done))
    assert done.text == "".join(SCRIPTS[model][1])
    parser = OutputParser(answer_format(engine.tokenizer, conversation))
    parser.feed(done.text)
    parser.finish()
    return parser.answer


def _for_template(messages) -> list[dict]:
    """The OpenAI messages above in the form templates take (arguments as a dict)."""
    out = []
    for message in messages:
        message = {**message, "content": message.get("content") or ""}
        if message.get("tool_calls"):
            message["tool_calls"] = [
                {**call, "function": {**call["function"], "arguments": json.loads(a)}}
                for call in message["tool_calls"]
                for a in [call["function"]["arguments"]]
            ]
        if message["role"] == "tool":
            message["name"] = "get_weather"
        out.append(message)
    return out


def calls_of(tool_calls) -> list[tuple[str, dict]]:
    return [(call.function.name, json.loads(call.function.arguments)) for call in tool_calls]


def streamed(client, model: str, messages=ASK, **extra) -> dict:
    """A streamed answer put together: reasoning, content, calls, finish, and the chunks."""
    chunks = list(create(client, model, messages, stream=True, **extra))
    reasoning = content = ""
    calls: dict[int, dict] = {}
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    for chunk in [c for c in chunks if c.choices and not c.choices[0].finish_reason]:
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
        for call in delta.tool_calls or ():
            if call.id is not None:  # the first delta of a call: its id, type and name
                assert call.index not in calls and call.type == "function"
                assert call.function.arguments == ""
                calls[call.index] = {"id": call.id, "name": call.function.name, "arguments": ""}
            else:
                assert call.function.name is None
                calls[call.index]["arguments"] += call.function.arguments
    assert len(finishes) == 1, finishes
    # `index` is the call's place in the message's `tool_calls` array: clients write each
    # delta into the array at it, so the first call is 0, with no holes.
    assert sorted(calls) == list(range(len(calls))), sorted(calls)
    made = [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)]
    return {
        "reasoning": reasoning,
        "content": content,
        "calls": made,
        "ids": [calls[i]["id"] for i in sorted(calls)],
        "finish": finishes[0],
        "chunks": chunks,
    }


def test_a_thinking_model_that_calls_tools_answers_with_reasoning_and_calls(client):
    response = create(client, "qwen3-calls")
    choice = choice_ = response.choices[0]
    message = choice.message
    plain = plain_answer("qwen3-calls", ASK)
    assert (
        message.model_extra["reasoning_content"]
        == plain.reasoning
        == "\nThe user asks for two cities.\n"
    )
    assert message.content is None
    assert calls_of(message.tool_calls) == CALLED
    assert [(c.name, json.loads(c.arguments)) for c in plain.tool_calls] == CALLED
    ids = [call.id for call in message.tool_calls]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == 2
    assert {call.type for call in message.tool_calls} == {"function"}
    assert choice_.finish_reason == "tool_calls"
    # <think>, its two pieces and </think>: the reasoning's four tokens, of ten.
    assert response.usage.completion_tokens_details.reasoning_tokens == 4
    assert response.model_extra["x_mlxspec"]["reasoning_tokens"] == 4
    assert response.usage.completion_tokens == 10


def test_a_streamed_answer_has_the_same_parts_in_openais_delta_form(client):
    whole = create(client, "qwen3-calls").choices[0].message
    stream = streamed(client, "qwen3-calls", stream_options={"include_usage": True})
    assert stream["reasoning"] == whole.model_extra["reasoning_content"]
    assert stream["content"] == ""  # no markup, not even the whitespace between calls
    assert stream["calls"] == CALLED
    assert all(i.startswith("call_") for i in stream["ids"])
    assert stream["finish"] == "tool_calls"
    assert stream["chunks"][-1].usage.completion_tokens_details.reasoning_tokens == 4


def test_a_history_with_a_tool_result_is_answered(client, provider):
    response = create(client, "qwen3-answers", HISTORY)
    message = response.choices[0].message
    assert message.content == "It is 18C and sunny."
    assert message.model_extra["reasoning_content"] == "\nThe tool said 18C.\n"
    assert message.tool_calls is None and response.choices[0].finish_reason == "stop"
    assert plain_answer("qwen3-answers", HISTORY) == ParsedAnswer(
        "\nThe tool said 18C.\n", "It is 18C and sunny."
    )
    # The prompt held the call and its result, as Qwen3's template writes them.
    tokenizer = provider.opened["qwen3-answers"].engine.tokenizer
    conversation = Conversation(_for_template(HISTORY), [WEATHER])
    expected = encode_chat(tokenizer, conversation, generation_prompt=True)
    assert response.usage.prompt_tokens == len(expected)
    prompt_text = tokenizer.decode(expected)
    assert "<tool_response>\n18C, sunny\n</tool_response>" in prompt_text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt_text


def test_streamed_content_keeps_its_provenance(client):
    stream = streamed(
        client, "qwen3-answers", HISTORY, extra_body={"mlxspec": {"provenance": True}}
    )
    assert stream["content"] == "It is 18C and sunny." and stream["finish"] == "stop"
    content_deltas = [
        c.choices[0].delta for c in stream["chunks"] if c.choices and c.choices[0].delta.content
    ]
    assert content_deltas and all(
        d.model_extra["x_mlxspec"]["provenance"] in ("accepted", "target") for d in content_deltas
    )


def test_a_model_without_tool_support_calls_in_the_fallback_format(client):
    response = create(client, "smollm2-calls")
    message = response.choices[0].message
    assert message.content == "I will check.\n"
    assert calls_of(message.tool_calls) == CALLED[:1]
    assert response.choices[0].finish_reason == "tool_calls"
    plain = plain_answer("smollm2-calls", ASK)
    assert plain.text == message.content and len(plain.tool_calls) == 1
    stream = streamed(client, "smollm2-calls")
    assert (stream["content"], stream["calls"]) == ("I will check.\n", CALLED[:1])


def test_concurrent_tool_requests_each_get_their_own_parts(client):
    requests = [("qwen3-calls", ASK), ("qwen3-calls", ASK), ("qwen3-calls", ASK)]
    with ThreadPoolExecutor(len(requests)) as pool:
        answers = list(pool.map(lambda r: create(client, *r).choices[0].message, requests))
    assert all(calls_of(a.tool_calls) == CALLED for a in answers)
    assert len({call.id for a in answers for call in a.tool_calls}) == 6


def plain_logprobs(model: str, messages) -> tuple:
    """Plain decoding's logprob entries for the conversation (with the likeliest
    alternative), checked against the model's one-token steps."""
    conversation = Conversation(_for_template(messages), [WEATHER])
    engine = ScriptedRuntime(model).engine
    settings = GenerationSettings(max_tokens=64, logprobs=1)
    done = list(engine.stream(conversation, settings, "none"))[-1]
    prompt = encode_chat(engine.tokenizer, conversation, generation_prompt=True)
    assert_plain_logprobs(engine.target.model, prompt, done, 1, model)
    return done.logprobs


@pytest.mark.parametrize(
    "model, messages",
    [
        ("qwen3-calls", ASK),
        ("qwen3-answers", HISTORY),
        ("qwen3-holds", ASK),
        ("smollm2-calls", ASK),
    ],
)
def test_logprobs_cover_every_token_once_in_order_whatever_the_parser_holds(
    client, model, messages
):
    """The parser holds text back (a marker's possible start, a call until it closes) and
    drops markup; each token's entry still comes once, in order, reasoning and markup
    included, streamed or not, and is plain decoding's."""
    expected = plain_logprobs(model, messages)
    assert [entry.text for entry in expected] == SCRIPTS[model][1]
    asked = dict(logprobs=True, top_logprobs=1)
    whole = create(client, model, messages, **asked)
    assert whole.usage.completion_tokens == len(expected)
    assert_chat_entries(whole.choices[0].logprobs.content, expected, 1)
    chunks = [c.choices[0] for c in streamed(client, model, messages, **asked)["chunks"]]
    entries = [e for c in chunks if c.logprobs for e in c.logprobs.content]
    assert_chat_entries(entries, expected, 1)


def test_tool_choice_none_keeps_tools_out_of_the_prompt_and_calls_as_text(client):
    response = create(client, "smollm2-calls", tool_choice="none")
    assert response.choices[0].message.tool_calls is None
    assert "<tool_call>" in response.choices[0].message.content
    without = create(client, "smollm2-calls", tools=())
    assert response.usage.prompt_tokens == without.usage.prompt_tokens


def test_template_arguments_come_from_the_request_over_the_models_default():
    provider = ScriptedProvider(template_kwargs={"enable_thinking": False})
    with serving(provider) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=60)
        off = create(client, "qwen3-answers", HELLO)  # the model's default: thinking off
        on = create(
            client,
            "qwen3-answers",
            HELLO,
            extra_body={"chat_template_kwargs": {"enable_thinking": True}},
        )
    closed_block = len("<think>\n\n</think>\n\n")  # Qwen3 closes the block in the prompt
    assert off.usage.prompt_tokens == on.usage.prompt_tokens + closed_block


BAD_TOOL_REQUESTS = [
    # (body, the parameter the error names)
    ({"messages": HISTORY[:1] + HISTORY[2:]}, "messages[1].tool_call_id"),
    (
        {"messages": [*HISTORY[:2], {**HISTORY[2], "tool_call_id": "call_8"}]},
        "messages[2].tool_call_id",
    ),
    ({"messages": [*HISTORY[:2], {"role": "tool", "content": "18C"}]}, "messages[2]"),
    ({"messages": ASK, "tools": [{"type": "function"}]}, "tools[0].function"),
    ({"messages": ASK, "tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
    ({"messages": ASK, "tools": [{"type": "code", "function": {"name": "x"}}]}, "tools[0].type"),
    ({"messages": ASK, "tools": {"name": "x"}}, "tools"),
    (
        {
            "messages": ASK,
            "tools": [{"type": "function", "function": {"name": "x", "parameters": 3}}],
        },
        "tools[0].function.parameters",
    ),
    ({"messages": ASK, "tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"messages": ASK, "tool_choice": "required"}, "tool_choice"),
    (
        {
            "messages": ASK,
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "get_time"}},
        },
        "tool_choice",
    ),
    (
        {
            "messages": [
                ASK[0],
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{oops"},
                        }
                    ],
                },
            ]
        },
        "messages[1].tool_calls[0].function.arguments",
    ),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0]"),
    ({"messages": ASK, "chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
]


@pytest.mark.parametrize("body, param", BAD_TOOL_REQUESTS)
def test_bad_tool_requests_get_a_400_naming_the_field_and_the_server_goes_on(base_url, body, param):
    response = httpx.post(f"{base_url}{CHAT}", json={"model": "qwen3-answers", **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["message"].startswith(param) or param == "tool_choice"
    assert error["type"] == "invalid_request_error" and error["code"]
    good = httpx.post(f"{base_url}{CHAT}", json={"model": "qwen3-answers", "messages": HISTORY})
    assert good.status_code == 200


def test_tools_leave_a_random_models_answer_as_plain_decoding_wrote_it():
    """No markup in it: the parser hands the text on whole, as the engine wrote it."""
    conversation = Conversation([{"role": "user", "content": "one two one two"}], [WEATHER])
    events = tiny_engine("tiny").stream(conversation, GenerationSettings(max_tokens=24), "none")
    plain = next(event for event in events if isinstance(event, Done)).text
    with serving(TinyProvider()) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=60)
        answer = create(client, "tiny", conversation.messages, max_tokens=24)
    assert answer.choices[0].message.content == plain and plain
    assert answer.choices[0].message.tool_calls is None


def test_provenance_marks_the_answers_text_only():
    """`provenance` says who wrote each piece of the answer's text; reasoning and calls
    carry no such field, as docs/serving.md says."""
    reply = Reply(chat=True, model="tiny")
    parts = (
        ReasoningText("Think."),
        AnswerText("Sunny."),
        ToolCallStarted(0, "call_0", "get_weather"),
        ToolCallArguments(0, "{}"),
    )
    chunks = reply.output_chunks(parts, Accepted((1,), "x"), True, None)
    marked = ["x_mlxspec" in chunk["choices"][0]["delta"] for chunk in chunks]
    assert marked == [False, True, False, False]
    assert chunks[1]["choices"][0]["delta"]["x_mlxspec"] == {"provenance": "accepted"}
