"""Ollama's dialect (`/api/*`) with the official `ollama` Python client against `serve` on
loopback: list, show, chat (streamed and whole), generate, generate with `suffix` (fill in
the middle: the greedy answer is plain greedy decoding of the same FIM prompt, with and
without speculation), `format`, tools and thinking; and the request shapes of the editors
that speak it (Continue, Zed, VS Code Copilot), replayed from fixtures in tests/data/.

The models: tiny random llamas; "coder" has StarCoder's FIM tokens in its vocabulary (the
byte tokenizer with `<fim_prefix>`, `<fim_suffix>`, `<fim_middle>` added), so its FIM
layout is found from its tokens as a real coder model's is; "tiny" has none. Tools and
thinking use the scripted models of test_tool_calls.py over real chat templates.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import ollama
import pytest
from test_server import RecordingEngine, serving
from test_structured_api import CITY, valid_city  # bounded: a random model's answer ends
from test_tool_calls import ScriptedProvider
from test_units import CPU_LIKE_COST
from tiny_models import FAMILIES, VOCAB, byte_tokenizer, tiny_model
from tool_examples import ASK, CALLED, WEATHER

from mlxspec.decoding.engine import GenerationSettings
from mlxspec.events import Done
from mlxspec.markup.fim import Infill
from mlxspec.proposers import DraftModel, PromptLookup, truncated_model
from mlxspec.registry.models_toml import Defaults
from mlxspec.server import ModelInfo, ServerLimits

DATA = Path(__file__).parent / "data" / "ollama"
FIM_PIECES = ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")
SEEDS = {"tiny": 1, "coder": 7}
PREFIX = "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    "
SUFFIX = "\n\n\ndef sub(a, b):\n    return a - b\n"
PREDICT = 24
GREEDY = {"temperature": 0, "num_predict": PREDICT}


def engine_of(name: str) -> RecordingEngine:
    """Prompt lookup and a draft model (the target's first two layers) as proposers."""
    pieces = FIM_PIECES if name == "coder" else ()
    config = {**FAMILIES["llama"], "vocab_size": VOCAB + len(pieces)}
    model = tiny_model("llama", seed=SEEDS[name], config=config)
    draft = DraftModel(truncated_model(model, 2), name="draft", k_max=4)
    return RecordingEngine(
        model, byte_tokenizer(pieces), name, [PromptLookup(), draft], verify_cost=CPU_LIKE_COST
    )


class Runtime:
    def __init__(self, name: str):
        self.engine = engine_of(name)

    def proposer(self, name: str | None) -> str:
        return "prompt-lookup" if name is None else name


class Provider:
    """The FIM model (the default) and one without FIM tokens."""

    default = "coder"

    def __init__(self):
        defaults = Defaults(max_tokens=32, context=1024)
        self.models = {
            name: ModelInfo(name, ("prompt-lookup", "draft", "none"), defaults) for name in SEEDS
        }
        self.opened: list[Runtime] = []

    def check(self, name: str, proposer: str | None) -> None:
        pass

    def open(self, name: str) -> Runtime:
        self.opened.append(Runtime(name))
        return self.opened[-1]


@pytest.fixture(scope="module")
def provider() -> Provider:
    return Provider()


@pytest.fixture(scope="module")
def base_url(provider) -> Iterator[str]:
    with serving(provider, preload="coder") as url:
        # As editors warm a model up: an empty generate returns once it is loaded
        assert httpx.post(f"{url}/api/generate", json={"model": "coder"}).json()["done"]
        yield url


@pytest.fixture()
def client(base_url) -> ollama.Client:
    return ollama.Client(host=base_url, timeout=60)


def plain(name: str, prompt, max_tokens: int = PREDICT) -> Done:
    """Plain greedy decoding (no proposer) by the engine alone; an Infill as its token ids."""
    engine = engine_of(name)
    settings = GenerationSettings(max_tokens=max_tokens, context=1024)
    if isinstance(prompt, Infill):
        prompt = engine.encode_infill(prompt, settings)
    events = engine.stream(prompt, settings, "none")
    return next(event for event in events if isinstance(event, Done))


def ndjson(response: httpx.Response) -> list[dict]:
    """Each line of the body one JSON object, as Ollama's clients read it."""
    lines = response.text.split("\n")
    assert lines[-1] == "", "the stream ends with a newline"
    return [json.loads(text) for text in lines[:-1]]


def ollama_error(response: httpx.Response) -> str:
    """The reason in Ollama's error shape, `{"error": "..."}` (its clients read a string)."""
    body = response.json()
    assert list(body) == ["error"] and isinstance(body["error"], str), body
    return body["error"]


def version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


# --- The model endpoints ---------------------------------------------------------------


def assert_zed_listing(listing: dict) -> None:
    """What Zed's `LocalModelListing` requires, with its types (serde fails otherwise)."""
    for key in ("name", "modified_at", "digest"):
        assert isinstance(listing[key], str), key
    assert isinstance(listing["size"], int)
    details = listing["details"]
    for key in ("format", "family", "parameter_size", "quantization_level"):
        assert isinstance(details[key], str), key
    assert all(isinstance(family, str) for family in details["families"])


def test_tags_lists_every_model_as_zed_and_the_client_parse_it(base_url, client):
    listed = httpx.get(f"{base_url}/api/tags").json()["models"]
    assert [entry["name"] for entry in listed] == list(SEEDS)
    for entry in listed:
        assert_zed_listing(entry)
        assert entry["model"] == entry["name"]
    resident = next(entry for entry in listed if entry["name"] == "coder")
    assert resident["size"] > 0 and resident["details"]["family"] == "llama"
    assert [model.model for model in client.list().models] == list(SEEDS)


def test_version_show_and_ps_say_what_copilot_and_continue_read(client):
    assert version_tuple(client._client.get("/api/version").json()["version"]) >= (0, 6, 4)
    shown = client.show("coder")
    arch = shown.modelinfo["general.architecture"]
    assert arch == "llama" and shown.modelinfo[f"{arch}.context_length"] == 1024
    assert shown.modelinfo["general.basename"] == "coder"
    assert "insert" in shown.capabilities and "completion" in shown.capabilities
    assert ".Suffix" in shown.template and "<fim_suffix>" in shown.template
    assert "num_ctx" in shown.parameters
    assert client.generate(model="tiny", prompt="").done_reason == "load"
    assert [model.name for model in client.ps().models] == ["tiny"]
    assert "insert" not in client.show("tiny").capabilities  # it has no FIM tokens
    # swapped out, the FIM model is still described as it was read in memory
    assert client.show("coder").capabilities == shown.capabilities
    assert [model.details.family for model in client.list().models] == ["llama", "llama"]


# --- Chat and generate -----------------------------------------------------------------

HELLO = [{"role": "user", "content": "one two one two"}]


def test_chat_whole_and_streamed_say_what_plain_greedy_says(client):
    expected = plain("tiny", HELLO).text
    whole = client.chat(model="tiny", messages=HELLO, options=GREEDY, stream=False)
    assert whole.message.role == "assistant" and whole.message.content == expected
    assert whole.done and whole.done_reason == "length" and whole.eval_count == PREDICT
    assert whole.prompt_eval_count > 0 and whole.total_duration >= whole.eval_duration >= 0
    lines = list(client.chat(model="tiny", messages=HELLO, options=GREEDY, stream=True))
    assert [line.done for line in lines] == [False] * (len(lines) - 1) + [True]
    assert "".join(line.message.content for line in lines) == expected
    assert lines[-1].eval_count == PREDICT and lines[-1].prompt_eval_duration is not None


def test_a_stream_is_one_compact_json_object_a_line(base_url):
    body = {"model": "tiny", "messages": HELLO, "options": GREEDY}
    response = httpx.post(f"{base_url}/api/chat", json=body, timeout=60)
    assert response.headers["content-type"].startswith("application/x-ndjson")
    lines = ndjson(response)
    assert len(lines) > 2 and lines[-1]["done"] is True
    assert all(set(line) >= {"model", "created_at", "message", "done"} for line in lines)
    final = lines[-1]
    for key in ("total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration"):
        assert isinstance(final[key], int), key
    assert final["eval_count"] == PREDICT and isinstance(final["eval_duration"], int)


def test_generate_raw_and_templated(client):
    raw = client.generate(model="tiny", prompt="one two one", raw=True, options=GREEDY)
    assert raw.response == plain("tiny", "one two one").text
    templated = client.generate(model="tiny", prompt="one two one two", options=GREEDY)
    assert templated.response == plain("tiny", HELLO).text


@pytest.mark.parametrize("proposer", [None, "none", "prompt-lookup", "draft"])
def test_generate_with_a_suffix_fills_the_middle_as_plain_greedy_does(base_url, provider, proposer):
    """The answer is plain greedy decoding of the FIM prompt, token for token, whatever
    drafts; the engine was handed the prefix and the suffix, not the prefix alone."""
    body = {"model": "coder", "prompt": PREFIX, "suffix": SUFFIX, "options": GREEDY}
    if proposer is not None:
        body["mlxspec"] = {"proposer": proposer}
    lines = ndjson(httpx.post(f"{base_url}/api/generate", json=body, timeout=60))
    expected = plain("coder", Infill(PREFIX, SUFFIX))
    assert "".join(line["response"] for line in lines) == expected.text
    assert lines[-1]["eval_count"] == len(expected.token_ids) == PREDICT
    run = provider.opened[-1].engine.runs[-1]
    assert run["prompt"] == Infill(PREFIX, SUFFIX)
    assert run["events"][-1].token_ids == expected.token_ids
    if proposer not in (None, "none"):
        assert lines[-1]["x_mlxspec"]["speculative"] is True


def test_fill_in_the_middle_requests_batched_together_each_say_plain_greedy():
    """Rows of one batch (continuous batching), each its own FIM prompt and proposer."""
    holes = [
        (PREFIX, SUFFIX, "none"),
        (PREFIX, SUFFIX, "prompt-lookup"),
        (
            "class Point:\n    def __init__(self, x, y):\n        ",
            "\n\n    def norm(self):\n",
            "draft",
        ),
    ]
    with serving(Provider(), preload="coder", limits=ServerLimits(max_batch=4)) as url:

        def fill(hole):
            prefix, suffix, proposer = hole
            body = {
                "model": "coder",
                "prompt": prefix,
                "suffix": suffix,
                "options": GREEDY,
                "stream": False,
                "mlxspec": {"proposer": proposer},
            }
            return httpx.post(f"{url}/api/generate", json=body, timeout=120).json()

        with ThreadPoolExecutor(len(holes)) as pool:
            answers = list(pool.map(fill, holes))
    for (prefix, suffix, _), answer in zip(holes, answers, strict=True):
        assert answer["response"] == plain("coder", Infill(prefix, suffix)).text


def test_the_client_fills_the_middle_whole_and_streamed(client):
    expected = plain("coder", Infill(PREFIX, SUFFIX)).text
    whole = client.generate(
        model="coder", prompt=PREFIX, suffix=SUFFIX, options=GREEDY, stream=False
    )
    assert whole.response == expected and whole.done_reason == "length"
    parts = client.generate(
        model="coder", prompt=PREFIX, suffix=SUFFIX, options=GREEDY, stream=True
    )
    assert "".join(part.response for part in parts) == expected


def test_stop_strings_end_the_answer_as_they_end_plain_decoding(client):
    """Any number of them (Continue sends eleven), the first met ends the answer."""
    whole = plain("tiny", "one two one").text
    stop = [whole[6:9], *(f"never{n}" for n in range(10))]
    options = {**GREEDY, "stop": stop}
    answer = client.generate(model="tiny", prompt="one two one", raw=True, options=options)
    settings = GenerationSettings(max_tokens=PREDICT, context=1024, stop=stop)
    events = engine_of("tiny").stream("one two one", settings, "none")
    expected = next(event for event in events if isinstance(event, Done))
    assert answer.response == expected.text and len(answer.response) < len(whole)
    assert answer.done_reason == "stop"


@pytest.mark.parametrize(
    "given, kind", [("json", "json_object"), (CITY, "json_schema"), ("", None), (None, None)]
)
def test_format_becomes_the_answers_response_format(given, kind):
    from mlxspec.server.ollama.schemas import GenerateRequest

    asked = GenerateRequest.model_validate({"prompt": "x", "format": given}).generation_request()
    assert (asked.response_format.type if asked.response_format else None) == kind


def test_a_model_without_fim_tokens_refuses_a_suffix_with_a_400(base_url, client):
    with pytest.raises(ollama.ResponseError) as refused:
        client.generate(model="tiny", prompt=PREFIX, suffix=SUFFIX)
    assert refused.value.status_code == 400 and "fill-in-the-middle" in refused.value.error
    body = {"model": "tiny", "prompt": PREFIX, "suffix": SUFFIX}
    response = httpx.post(f"{base_url}/api/generate", json=body, timeout=60)
    assert response.status_code == 400 and ollama_error(response)


@pytest.mark.parametrize("route", ["chat", "generate"])
def test_a_format_schema_makes_a_valid_answer(client, route):
    options = {"temperature": 0, "num_predict": 80}
    if route == "chat":
        content = client.chat(
            model="tiny", messages=HELLO, format=CITY, options=options
        ).message.content
    else:
        content = client.generate(
            model="tiny", prompt="one two", format=CITY, options=options
        ).response
    assert valid_city(json.loads(content)), content


@pytest.mark.parametrize(
    "route, body, status, says",
    [
        ("generate", {"model": "nope", "prompt": "x"}, 404, "unknown model"),
        ("chat", {"model": "nope", "messages": HELLO}, 404, "unknown model"),
        ("generate", {"model": "tiny", "prompt": "x", "images": ["aGk="]}, 400, "images"),
        ("chat", {"model": "tiny", "messages": [{**HELLO[0], "images": ["aGk="]}]}, 400, "images"),
        (
            "generate",
            {"model": "tiny", "prompt": "x", "template": "{{ .Prompt }}"},
            400,
            "template",
        ),
        ("generate", {"model": "tiny", "prompt": "x", "context": [1, 2]}, 400, "context"),
        ("generate", {"model": "tiny", "prompt": "x", "raw": True, "system": "s"}, 400, "system"),
        (
            "generate",
            {"model": "tiny", "prompt": "x", "options": {"temperature": "hot"}},
            400,
            "temperature",
        ),
        ("generate", {"model": "tiny", "prompt": "x", "format": "xml"}, 400, "format"),
        ("show", {"model": "nope"}, 404, "unknown model"),
    ],
)
def test_errors_come_in_ollamas_shape(base_url, route, body, status, says):
    response = httpx.post(f"{base_url}/api/{route}", json=body, timeout=60)
    assert response.status_code == status
    assert says in ollama_error(response)


def test_the_bare_address_answers_ollamas_probe(base_url):
    assert httpx.get(base_url).text == "Ollama is running"
    assert httpx.head(base_url).status_code == 200


def test_an_unknown_route_is_a_404_in_ollamas_shape(base_url):
    response = httpx.post(f"{base_url}/api/embed", json={"model": "tiny", "input": "x"})
    assert response.status_code == 404 and ollama_error(response)


def test_the_api_key_guards_ollamas_routes_too():
    with serving(Provider(), api_key="sesame") as url:
        refused = httpx.get(f"{url}/api/tags")
        assert refused.status_code == 401 and ollama_error(refused)
        listed = ollama.Client(host=url, headers={"Authorization": "Bearer sesame"}).list()
        assert [model.model for model in listed.models] == list(SEEDS)


# --- Tools and thinking ------------------------------------------------------------------


@pytest.fixture(scope="module")
def scripted_url() -> Iterator[str]:
    with serving(ScriptedProvider(), limits=ServerLimits(max_batch=1)) as url:
        yield url


def test_tool_calls_come_with_object_arguments_whole_and_streamed(scripted_url):
    client = ollama.Client(host=scripted_url, timeout=60)
    asked = dict(model="qwen3-calls", messages=ASK, tools=[WEATHER], options={"temperature": 0})
    whole = client.chat(**asked, stream=False)
    made = [
        (call.function.name, dict(call.function.arguments)) for call in whole.message.tool_calls
    ]
    assert made == CALLED and whole.message.thinking.strip() == "The user asks for two cities."
    lines = list(client.chat(**asked, stream=True))
    streamed = [
        (call.function.name, dict(call.function.arguments))
        for line in lines
        for call in line.message.tool_calls or ()
    ]
    assert streamed == CALLED and lines[-1].done
    assert "".join(line.message.thinking or "" for line in lines) == whole.message.thinking
    shown = client.show("qwen3-calls")
    assert {"tools", "thinking"} <= set(shown.capabilities)


@pytest.mark.parametrize("think, thinking", [(False, "off"), (True, "on")])
def test_think_turns_the_templates_thinking_switch(scripted_url, think, thinking):
    body = {"model": "qwen3-answers", "messages": ASK, "think": think, "stream": False}
    response = httpx.post(f"{scripted_url}/api/chat", json=body, timeout=60)
    assert response.json()["x_mlxspec"]["thinking"] == thinking


def test_a_history_with_ollamas_tool_calls_and_results_is_answered(scripted_url):
    """Ollama's calls carry no id and their arguments as an object; a result names its
    tool (`tool_name`): each is tied to the call it answers."""
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "tool_name": "get_weather", "content": "18C, sunny"},
    ]
    body = {"model": "qwen3-answers", "messages": history, "stream": False}
    response = httpx.post(f"{scripted_url}/api/chat", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["message"]["content"] == "It is 18C and sunny."


def test_each_tool_result_answers_its_own_call():
    """Results are tied in order to the calls not yet answered: by id, else by the tool
    they name (two calls of one tool get one result each), else to the next call."""
    from mlxspec.server.ollama.schemas import ChatRequest

    weather = "get_weather"
    request = ChatRequest.model_validate(
        {
            "messages": [
                *ASK,
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {"function": {"name": weather, "arguments": {"city": "Paris"}}},
                        {"function": {"name": weather, "arguments": '{"city": "Rome"}'}},
                        {"function": {"name": "get_time", "arguments": {}}},
                    ],
                },
                {"role": "tool", "tool_name": weather, "content": "18C"},
                {"role": "tool", "tool_name": weather, "content": "9C"},
                {"role": "tool", "content": "noon"},
            ]
        }
    )
    messages = request.conversation({}).messages
    calls = messages[1]["tool_calls"]
    assert calls[1]["function"]["arguments"] == {"city": "Rome"}
    assert len({call["id"] for call in calls}) == 3
    answered = [(message["tool_call_id"], message["name"]) for message in messages[2:]]
    assert answered == [(call["id"], call["function"]["name"]) for call in calls]


# --- Editors' requests, replayed --------------------------------------------------------
#
# Each fixture (tests/data/ollama/) holds the requests an editor sends, in the order it sends
# them, as its source writes them (the file and functions are named in the fixture), and
# what the editor reads of each answer: the checks below read it the same way.

# Continue's parse of each `parameters` line (its Ollama constructor)
CONTINUE_PARAMETER = re.compile(r'^(\S+)\s+((?:".*")|\S+)$')


def read_tags_names(response: httpx.Response) -> None:
    assert [model["name"] for model in response.json()["models"]] == list(SEEDS)


def read_tags_zed(response: httpx.Response) -> None:
    for listing in response.json()["models"]:
        assert_zed_listing(listing)


def read_show_continue(response: httpx.Response) -> None:
    shown = response.json()
    assert ".Suffix" in shown["template"]  # how Continue decides the model fills the middle
    lines = shown["parameters"].split("\n")
    assert all(CONTINUE_PARAMETER.match(line) for line in lines), lines
    assert int(CONTINUE_PARAMETER.match(lines[0]).group(2)) == 1024


def read_show_zed(response: httpx.Response) -> None:
    assert all(isinstance(capability, str) for capability in response.json()["capabilities"])


def read_show_copilot(response: httpx.Response) -> None:
    info = response.json()["model_info"]
    assert isinstance(info[f"{info['general.architecture']}.context_length"], int)
    assert isinstance(info["general.basename"], str)
    assert isinstance(response.json()["capabilities"], list)


def read_version(response: httpx.Response) -> None:
    assert version_tuple(response.json()["version"]) >= (0, 6, 4)


def read_generate_stream(response: httpx.Response) -> None:
    lines = ndjson(response)
    assert all(isinstance(line["response"], str) for line in lines) and lines[-1]["done"]


def read_chat_stream(response: httpx.Response) -> None:
    lines = ndjson(response)
    for line in lines:
        assert isinstance(line["model"], str) and isinstance(line["created_at"], str)
        assert line["message"]["role"] == "assistant"
        assert isinstance(line["message"]["content"], str)
    assert [line["done"] for line in lines] == [False] * (len(lines) - 1) + [True]
    assert isinstance(lines[-1]["eval_count"], int)


def read_chat_whole(response: httpx.Response) -> None:
    body = response.json()
    assert body["done"] is True and isinstance(body["message"]["content"], str)


def read_openai_stream(response: httpx.Response) -> None:
    events = [text for text in response.text.split("\n\n") if text.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and json.loads(events[0][6:])["model"] == "tiny"


READS = {
    name.removeprefix("read_").replace("_", "-"): read
    for name, read in globals().items()
    if name.startswith("read_")
}


@pytest.mark.parametrize("editor", ["continue", "zed", "copilot"])
def test_an_editors_requests_replay(base_url, provider, editor):
    fixture = json.loads((DATA / f"{editor}.json").read_text())
    for step in fixture["steps"]:
        response = httpx.request(
            step["method"], base_url + step["path"], json=step.get("body"), timeout=60
        )
        assert response.status_code == 200, (step["path"], response.text)
        READS[step["reads"]](response)
        if step.get("body", {}).get("suffix"):  # the engine was asked to fill the middle
            run = provider.opened[-1].engine.runs[-1]
            assert run["prompt"] == Infill(step["body"]["prompt"], step["body"]["suffix"])


# --- The official JS client (npm) ---------------------------------------------------------
#
# Run where `ollama` from npm is installed: MLXSPEC_OLLAMA_JS names the folder that holds its
# node_modules (`npm install ollama` there); the suite never downloads it.


def test_the_js_client_lists_shows_chats_and_fills_the_middle(base_url):
    folder = os.environ.get("MLXSPEC_OLLAMA_JS")
    node = shutil.which("node")
    if not folder or node is None or not (Path(folder) / "node_modules" / "ollama").is_dir():
        pytest.skip("set MLXSPEC_OLLAMA_JS to a folder where `npm install ollama` ran")
    script = Path(folder) / "js_client.mjs"  # beside node_modules, so its import resolves
    shutil.copy(DATA / "js_client.mjs", script)
    done = subprocess.run(
        [node, str(script), base_url, PREFIX, SUFFIX, str(PREDICT)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    read = json.loads(done.stdout)
    filled = plain("coder", Infill(PREFIX, SUFFIX)).text
    assert read["names"] == list(SEEDS) and "insert" in read["capabilities"]
    assert read["chat"] == plain("tiny", HELLO).text
    assert read["filled"] == read["whole"] == filled
    assert read["refused"]["status"] == 400 and "fill-in-the-middle" in read["refused"]["error"]


# --- The packaged SmolLM2, through the Ollama route -----------------------------------------


@pytest.mark.slow
def test_smollm2_chats_the_same_through_ollama_and_openai_with_every_proposer(smollm2):
    """A real model and its real chat template: the streamed /api/chat answer is the same
    greedy text with and without drafts, and the same as /v1/chat/completions'."""
    import openai

    from mlxspec.registry.models_toml import load_registry
    from mlxspec.registry.runtime import Runtime
    from mlxspec.server.providers import OpenedProvider

    entry = load_registry(user_file=None).get("smollm2-135m")
    provider = OpenedProvider(Runtime(entry, smollm2, notify=print), entry)
    messages = [{"role": "user", "content": "Repeat exactly, twice: def add(a, b): return a + b"}]
    options = {"temperature": 0, "num_predict": 48}
    with serving(provider) as url:
        texts = {}
        for proposer in ("none", "prompt-lookup", "suffix"):
            body = {"model": entry.name, "messages": messages, "options": options}
            lines = ndjson(
                httpx.post(
                    f"{url}/api/chat", json={**body, "mlxspec": {"proposer": proposer}}, timeout=300
                )
            )
            texts[proposer] = "".join(line["message"]["content"] for line in lines)
            assert lines[-1]["x_mlxspec"]["lossless"] is True
        assert texts["none"] and len(set(texts.values())) == 1, texts
        shown = ollama.Client(host=url).show(entry.name)
        assert shown.modelinfo["general.architecture"] == "llama"
        chat = openai.OpenAI(base_url=f"{url}/v1", api_key="-").chat.completions.create(
            model=entry.name, messages=messages, temperature=0, max_tokens=48
        )
        assert chat.choices[0].message.content == texts["none"]
