"""gpt-oss's harmony, Qwen3.5's and Gemma 4's formats through the server, with the official
`openai` and `anthropic` clients: a tool call with its reasoning apart, streamed and not,
then the tool's result fed back and answered. The models are tiny llamas rigged to write
each format's markup (scripted.py) over the real templates (templates/README.md)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import openai
import pytest
from scripted import scripted_model, scripted_tokenizer
from test_server import RecordingEngine, serving
from test_tool_calls import calls_of, streamed
from test_units import CPU_LIKE_COST
from tiny_models import byte_tokenizer, tiny_model
from tool_examples import ASK, TEMPLATES, WEATHER

from mlxspec.decoding.engine import Engine
from mlxspec.events import Done
from mlxspec.markup.chat_template import encode_chat, render_chat
from mlxspec.markup.conversation import Conversation
from mlxspec.proposers import DraftModel, PromptLookup, truncated_model
from mlxspec.registry.models_toml import Defaults
from mlxspec.server import ModelInfo

PARIS = [("get_weather", {"city": "Paris"})]
THINKING = {"enable_thinking": True}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
RESULT = [
    {"role": "assistant", "content": None, "tool_calls": [CALL], "reasoning_content": "Need it."},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"},
]
HISTORY = [*ASK, *RESULT]

# name: (template, its arguments, the answer's pieces (a token each), the conversation
# whose prompt the answer follows, the reasoning, the text)
SCRIPTS = {
    "gpt-oss-calls": (
        "gpt-oss.jinja",
        {},
        [
            "<|channel|>analysis<|message|>",
            "Need the",
            " weather tool.",
            "<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|cons",
            'train|>json<|message|>{"city": ',
            '"Paris"}',  # then the end token: gpt-oss's <|call|>
        ],
        ASK,
        "Need the weather tool.",
        "",
    ),
    "gpt-oss-answers": (
        "gpt-oss.jinja",
        {},
        [
            "<|channel|>analysis<|message|>",
            "The tool said 18C.",
            "<|end|><|start|>assistant<|channel|>final<|message|>",
            "It is 18C",
            " and sunny.",
            "<|return|>",
        ],
        HISTORY,
        "The tool said 18C.",
        "It is 18C and sunny.",
    ),
    "qwen3.5-calls": (  # thinking on: the prompt opened <think>
        "qwen3.5.jinja",
        THINKING,
        [
            "The user wants Paris.",
            "\n</think>\n\n",
            "<tool_call>\n<function=get_weather>\n",
            "<parameter=city>\nParis\n</parameter>\n",
            "</function>\n</tool_call>",
        ],
        ASK,
        "The user wants Paris.\n",
        "",
    ),
    "gemma4-calls": (
        "gemma4.jinja",
        THINKING,
        [
            "<|channel>thought\n",
            "Need the tool.",
            "<channel|>",
            '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}',
            "<tool_call|>",
        ],
        ASK,
        "\nNeed the tool.",
        "",
    ),
}
CALLS = ["gpt-oss-calls", "qwen3.5-calls", "gemma4-calls"]


def for_template(messages: list[dict]) -> list[dict]:
    """The OpenAI messages above as the server hands them to templates."""
    out = []
    for message in messages:
        message = {**message, "content": message["content"] or ""}
        if message.get("tool_calls"):
            function = {"name": "get_weather", "arguments": {"city": "Paris"}}
            message["tool_calls"] = [{**CALL, "function": function}]
        if message["role"] == "tool":
            message["name"] = "get_weather"
        out.append(message)
    return out


class FormatRuntime:
    def __init__(self, name: str):
        template, kwargs, pieces, messages, *_ = SCRIPTS[name]
        tokenizer = scripted_tokenizer(pieces, (TEMPLATES / template).read_text())
        conversation = Conversation(for_template(messages), [WEATHER], kwargs)
        last = encode_chat(tokenizer, conversation, generation_prompt=True)[-1]
        model = scripted_model(tokenizer, pieces, last)
        self.engine = Engine(model, tokenizer, name, [PromptLookup()], verify_cost=CPU_LIKE_COST)

    def proposer(self, name: str | None) -> str:
        return "prompt-lookup" if name is None else name


# Tiny random llamas over the real templates, for forced calls: what they write is the
# grammar's doing. name: (template, its arguments)
RANDOM = {"qwen3.5-tiny": ("qwen3.5.jinja", {}), "gemma4-tiny": ("gemma4.jinja", {})}


class RandomRuntime:
    """A random tiny llama and its own first layers as a draft: drafts it rejects too."""

    def __init__(self, name: str):
        template, _ = RANDOM[name]
        tokenizer = byte_tokenizer()
        tokenizer._tokenizer.chat_template = (TEMPLATES / template).read_text()
        model = tiny_model("llama", seed=4)  # one that calls rather than thinks, in both
        draft = DraftModel(truncated_model(model, 2), name="draft", k_max=4)
        self.engine = RecordingEngine(
            model, tokenizer, name, [PromptLookup(), draft], verify_cost=CPU_LIKE_COST
        )

    def proposer(self, name: str | None) -> str:
        return "draft" if name is None else name


class FormatProvider:
    default = "gpt-oss-calls"

    def __init__(self):
        kwargs = {name: script[1] for name, script in SCRIPTS.items()}
        kwargs.update({name: random[1] for name, random in RANDOM.items()})
        self.models = {
            name: ModelInfo(
                name,
                ("prompt-lookup", "draft", "none"),
                Defaults(max_tokens=64, context=2048, chat_template_kwargs=template_kwargs),
            )
            for name, template_kwargs in kwargs.items()
        }
        self.opened: dict[str, FormatRuntime | RandomRuntime] = {}

    def check(self, name: str, proposer: str | None) -> None:
        pass

    def open(self, name: str) -> FormatRuntime | RandomRuntime:
        runtime = RandomRuntime if name in RANDOM else FormatRuntime
        self.opened[name] = self.opened.get(name) or runtime(name)
        return self.opened[name]


@pytest.fixture(scope="module")
def provider() -> FormatProvider:
    return FormatProvider()


@pytest.fixture(scope="module")
def base_url(provider) -> Iterator[str]:
    with serving(provider) as url:
        yield url


@pytest.fixture()
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="-", max_retries=0, timeout=60)


@pytest.fixture()
def claude(base_url) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key="-", max_retries=0, timeout=60)


def create(client, model: str, messages=ASK, **extra):
    return client.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER], temperature=0, **extra
    )


@pytest.mark.parametrize("model", CALLS)
def test_openai_chat_gets_the_reasoning_and_the_call_streamed_or_not(client, model):
    *_, reasoning, text = SCRIPTS[model]
    response = create(client, model)
    message = response.choices[0].message
    assert message.model_extra["reasoning_content"] == reasoning
    assert (message.content or "") == text
    assert calls_of(message.tool_calls) == PARIS
    assert response.choices[0].finish_reason == "tool_calls"
    assert response.usage.completion_tokens_details.reasoning_tokens > 0
    stream = streamed(client, model)
    assert (stream["reasoning"], stream["content"], stream["calls"]) == (reasoning, text, PARIS)
    assert stream["finish"] == "tool_calls"


def test_a_harmony_tool_result_and_the_reasoning_before_the_call_reach_the_model(client, provider):
    response = create(client, "gpt-oss-answers", HISTORY)
    message = response.choices[0].message
    assert message.content == "It is 18C and sunny." and message.tool_calls is None
    assert message.model_extra["reasoning_content"] == "The tool said 18C."
    assert response.choices[0].finish_reason == "stop"
    # The prompt is gpt-oss's template over the call, the reasoning before it and the
    # result, as the template writes them.
    tokenizer = provider.opened["gpt-oss-answers"].engine.tokenizer
    conversation = Conversation(for_template(HISTORY), [WEATHER])
    assert response.usage.prompt_tokens == len(
        encode_chat(tokenizer, conversation, generation_prompt=True)
    )
    prompt = render_chat(tokenizer, conversation)
    assert prompt.endswith(
        "<|start|>assistant<|channel|>analysis<|message|>Need it.<|end|>"
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
        '{"city": "Paris"}<|call|>'
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
        '"18C, sunny"<|end|><|start|>assistant'
    )
    stream = streamed(client, "gpt-oss-answers", HISTORY)
    assert (stream["reasoning"], stream["content"]) == ("The tool said 18C.", message.content)


ANTHROPIC_TOOL = {
    "name": "get_weather",
    "description": WEATHER["function"]["description"],
    "input_schema": WEATHER["function"]["parameters"],
}


@pytest.mark.parametrize("model", CALLS)
def test_anthropic_messages_get_thinking_and_tool_use_blocks_streamed_or_not(claude, model):
    *_, reasoning, text = SCRIPTS[model]
    expected = ["thinking", *(["text"] if text else []), "tool_use"]
    asked = dict(model=model, max_tokens=64, messages=ASK, tools=[ANTHROPIC_TOOL])
    answer = claude.messages.create(**asked)
    assert [block.type for block in answer.content] == expected
    assert answer.content[0].thinking == reasoning
    assert (answer.content[-1].name, answer.content[-1].input) == PARIS[0]
    assert answer.stop_reason == "tool_use"
    with claude.messages.stream(**asked) as stream:
        final = stream.get_final_message()
    assert [block.type for block in final.content] == expected
    assert final.content[0].thinking == reasoning
    assert (final.content[-1].name, final.content[-1].input) == PARIS[0]


def test_anthropic_tool_result_with_earlier_thinking_is_answered_in_harmony(claude):
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Need it.", "signature": ""},
                {"type": "text", "text": "Checking."},  # a preamble, joined to the thinking
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}},
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C"}],
        },
    ]
    answer = claude.messages.create(
        model="gpt-oss-answers", max_tokens=64, messages=history, tools=[ANTHROPIC_TOOL]
    )
    assert [block.type for block in answer.content] == ["thinking", "text"]
    assert answer.content[0].thinking == "The tool said 18C."
    assert answer.content[1].text == "It is 18C and sunny." and answer.stop_reason == "end_turn"


def test_harmony_answers_only_text_where_the_request_gave_no_tools(client):
    response = client.chat.completions.create(model="gpt-oss-calls", messages=ASK)
    message = response.choices[0].message
    assert message.tool_calls is None and json.loads(message.content) == {"city": "Paris"}


# Bounded values (a random model's call ends within 250 byte tokens), one of each kind the
# formats write differently: a raw string, JSON numbers and booleans, an enum.
TRIP = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "metric": {"type": "boolean"},
        "unit": {"type": "string", "enum": ["C", "F"]},
    },
    "required": ["city", "days", "unit"],
    "additionalProperties": False,
}
PLAN = {"type": "function", "function": {"name": "plan_trip", "parameters": TRIP}}
ZONE = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": ZONE}}


def valid_trip(arguments: dict) -> bool:
    return (
        set(arguments) <= set(TRIP["properties"])
        and {"city", "days", "unit"} <= set(arguments)
        and isinstance(arguments["city"], str)
        and len(arguments["city"]) <= 6
        and type(arguments["days"]) is int
        and 1 <= arguments["days"] <= 9
        and type(arguments.get("metric", True)) is bool
        and arguments["unit"] in ("C", "F")
    )


@pytest.mark.parametrize("model", list(RANDOM))
@pytest.mark.parametrize(
    "choice", [{"type": "function", "function": {"name": "plan_trip"}}, "required"]
)
def test_a_forced_call_in_qwen35s_or_gemma4s_format_is_constrained_plain_decodings(
    client, provider, model, choice
):
    response = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=[PLAN, TIME],
        tool_choice=choice,
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=250,
    )
    (call,) = response.choices[0].message.tool_calls
    arguments = json.loads(call.function.arguments)
    if call.function.name == "plan_trip":
        assert valid_trip(arguments), arguments
    else:
        assert choice == "required" and arguments in ({"zone": "UTC"}, {"zone": "CET"})
    assert response.choices[0].finish_reason == "tool_calls"
    # Token for token what plain decoding under the same grammar writes (the server
    # speculated: the grammar's forced tokens and the draft model's drafts).
    engine = provider.opened[model].engine
    run = engine.runs[-1]
    speculated = next(event for event in run["events"] if isinstance(event, Done))
    assert speculated.record.verify_steps < len(speculated.token_ids)
    events = engine.stream(run["prompt"], run["settings"], "none")
    plain = next(event for event in events if isinstance(event, Done))
    assert speculated.token_ids == plain.token_ids


def test_anthropic_forced_tool_use_in_gemma4s_format_is_a_tool_use_block(claude):
    tool = {"name": "plan_trip", "input_schema": TRIP}
    message = claude.messages.create(
        model="gemma4-tiny",
        max_tokens=250,
        messages=ASK,
        tools=[tool],
        tool_choice={"type": "tool", "name": "plan_trip", "disable_parallel_tool_use": True},
        extra_body={"temperature": 0},
    )
    (block,) = [block for block in message.content if block.type == "tool_use"]
    assert block.name == "plan_trip" and valid_trip(block.input), block
    assert message.stop_reason == "tool_use"
