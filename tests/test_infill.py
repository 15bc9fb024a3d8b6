"""Fill-in-the-middle: the model's FIM layout found from its tokens, a request laid out with
it, and its three doors — llama.cpp's `/infill` (as llama.vim sends it), `/completion`, and
`suffix` in OpenAI's `/v1/completions` — on a tiny random llama whose tokenizer has Qwen2.5-
Coder's FIM tokens, served by a real uvicorn server."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from scripted import scripted_model
from test_server import ECHO, TinyProvider, serving
from test_units import CPU_LIKE_COST
from tiny_models import FAMILIES, byte_tokenizer, tiny_model

from mlxspec.decoding.engine import Engine, GenerationSettings
from mlxspec.decoding.text import TextStream
from mlxspec.events import Done
from mlxspec.markup.fim import (
    FAMILIES as FIM_FAMILIES,
)
from mlxspec.markup.fim import (
    ExtraFile,
    FimError,
    Infill,
    InfillBudget,
    encode_infill,
    find_layout,
)
from mlxspec.proposers import PromptLookup
from mlxspec.registry.models_toml import Defaults
from mlxspec.server import ModelInfo, ServerLimits
from mlxspec.settings import NoFimTokens

QWEN_FIM = [t for t in FIM_FAMILIES["qwen"] if t]  # prefix, suffix, middle, pad, repo, sep
CONTEXT = 4096


def fim_tokenizer():
    """The byte tokenizer with Qwen2.5-Coder's FIM tokens, marked special as in its
    tokenizer.json (so text that spells one is not taken for it unless asked)."""
    tokenizer = byte_tokenizer(QWEN_FIM)
    tokenizer._tokenizer.add_special_tokens({"additional_special_tokens": QWEN_FIM})
    return tokenizer


def fim_engine(seed: int = 0) -> Engine:
    config = {**FAMILIES["llama"], "vocab_size": 257 + len(QWEN_FIM)}
    model = tiny_model("llama", seed=seed, config=config)
    return Engine(model, fim_tokenizer(), "fim", [PromptLookup()], verify_cost=CPU_LIKE_COST)


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


# --- the layout --------------------------------------------------------------------------


class Vocab:
    """A tokenizer as find_layout sees it: its vocabulary (and a GGUF file's FIM ids)."""

    def __init__(self, texts: list[str], gguf: dict | None = None):
        self.vocab = {text: 10 + i for i, text in enumerate(texts)}
        self.gguf_fim_token_ids = gguf

    def get_vocab(self) -> dict[str, int]:
        return self.vocab

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return next(text for text, known in self.vocab.items() if known == token_id)


@pytest.mark.parametrize("family", ["qwen", "starcoder", "deepseek", "codellama", "codestral"])
def test_each_family_is_found_by_its_token_texts(family):
    texts = [t for t in FIM_FAMILIES[family] if t]
    layout = find_layout(Vocab(["<|endoftext|>", *texts]))
    assert layout is not None and layout.family == family
    vocab = Vocab(["<|endoftext|>", *texts]).vocab
    assert (layout.prefix, layout.suffix) == (vocab[texts[0]], vocab[texts[1]])
    assert layout.suffix_first == (family == "codestral")
    assert vocab["<|endoftext|>"] in layout.end_ids


def test_a_gguf_files_fim_ids_win_over_the_texts():
    texts = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<PRE>", "<SUF>", "<MID>"]
    gguf = {"fim_pre": 13, "fim_suf": 14, "fim_mid": 15}  # the file names CodeLlama's
    layout = find_layout(Vocab(texts, gguf))
    assert (layout.prefix, layout.suffix, layout.middle) == (13, 14, 15)


def test_a_model_without_fim_tokens_has_no_layout_and_a_setting_can_turn_fim_off():
    assert find_layout(Vocab(["<s>", "</s>"])) is None
    assert find_layout(Vocab(QWEN_FIM), "none") is None
    with pytest.raises(FimError, match="has no deepseek tokens"):
        find_layout(Vocab(QWEN_FIM), "deepseek")
    with pytest.raises(FimError, match="suffix first only"):
        find_layout(Vocab(["[PREFIX]", "[SUFFIX]"]), order="psm")


def test_prefix_suffix_middle_with_extra_files_laid_out_the_repo_level_way():
    tokenizer = fim_tokenizer()
    layout = find_layout(tokenizer)
    pre, suf, mid, _pad, repo, sep = (tokenizer.get_vocab()[t] for t in QWEN_FIM)
    infill = Infill("def f(x):\n    ", "\nprint(f(2))\n", (ExtraFile("a.py", "X = 1\n"),), "ret")
    got = encode_infill(tokenizer, layout, infill, InfillBudget(CONTEXT, 64))
    expected = [repo, *ids(tokenizer, "myproject\n"), sep, *ids(tokenizer, "a.py\n")]
    expected += [*ids(tokenizer, "X = 1\n"), sep, *ids(tokenizer, "filename\n")]
    expected += [pre, *ids(tokenizer, "def f(x):\n    "), *ids(tokenizer, "ret")]
    expected += [suf, *ids(tokenizer, "\nprint(f(2))\n"), mid]
    assert got == expected


def test_suffix_first_puts_only_the_prefix_after_what_changes_least():
    tokenizer = fim_tokenizer()
    layout = find_layout(tokenizer, order="spm")
    pre, suf, mid = (tokenizer.get_vocab()[t] for t in QWEN_FIM[:3])
    got = encode_infill(tokenizer, layout, Infill("ab", "cd"), InfillBudget(CONTEXT, 64))
    tail = [suf, *ids(tokenizer, "cd"), pre, *ids(tokenizer, "ab"), mid]
    assert got[-len(tail) :] == tail


def test_the_budget_keeps_the_prefixs_end_the_suffixs_start_and_the_newest_extra():
    tokenizer = fim_tokenizer()
    layout = find_layout(tokenizer)
    budget = InfillBudget(context=200, max_tokens=10, batch=40)  # prefix 30, suffix 8
    extra = (ExtraFile("old.py", "o" * 300), ExtraFile("new.py", "n" * 50))
    infill = Infill("P" * 100 + "end", "start" + "S" * 100, extra)
    text = tokenizer.decode(encode_infill(tokenizer, layout, infill, budget))
    prefix = text.split("<|fim_prefix|>")[1].split("<|fim_suffix|>")[0]
    suffix = text.split("<|fim_suffix|>")[1].split("<|fim_middle|>")[0]
    assert prefix.endswith("end") and len(prefix) == 30
    assert suffix.startswith("start") and len(suffix) == 8
    assert "n" * 50 in text and text.count("o") < 300  # 200 - 40 - 2 * 10 = 140 tokens


def test_code_that_spells_a_fim_token_is_text_not_the_marker():
    tokenizer = fim_tokenizer()
    layout = find_layout(tokenizer)
    got = encode_infill(tokenizer, layout, Infill("s = '<|fim_middle|>'", ""), InfillBudget(999, 9))
    assert got.count(layout.middle) == 1 and got[-1] == layout.middle


# --- the engine ----------------------------------------------------------------------------


def answer(engine: Engine, prompt, proposer: str | None, **settings) -> Done:
    asked = {"max_tokens": 48, "context": CONTEXT, **settings}
    events = engine.stream(prompt, GenerationSettings(**asked), proposer)
    return next(event for event in events if isinstance(event, Done))


def test_greedy_infill_with_prompt_lookup_is_plain_greedy_token_for_token():
    copied = "one two three four five six seven eight nine ten"
    infill = Infill(f"# {copied}\nx = '", f"'\n# {copied}\n", (ExtraFile("b.py", copied),))
    plain = answer(fim_engine(), infill, "none")
    speculative = answer(fim_engine(), infill, "prompt-lookup", k=4)
    assert speculative.token_ids == plain.token_ids
    assert speculative.record.drafted > 0


def test_a_model_without_fim_tokens_refuses_an_infill_by_name():
    engine = Engine(tiny_model("llama"), byte_tokenizer(), "plain", verify_cost=CPU_LIKE_COST)
    with pytest.raises(NoFimTokens, match="plain has no fill-in-the-middle tokens"):
        engine.check_request(Infill("a", "b"), GenerationSettings(), None)


def test_a_less_indented_line_ends_the_text_where_its_code_begins():
    class Pieces:  # a detokenizer whose tokens are the pieces themselves
        last_segment = ""

        def reset(self):
            pass

        def add_token(self, piece):
            self.last_segment = piece

        def finalize(self):
            self.last_segment = ""

    class Tokenizer:
        detokenizer = Pieces()

    stream = TextStream(Tokenizer(), min_indent=4)
    shown = []
    for piece in ["x = 1", "\n    y", " = 2\n", "  ", "z = 3\n", "w"]:
        stream.add("accepted", piece)
        shown += [p.text for p in stream.release()]
    assert "".join(shown) == "x = 1\n    y = 2\n  " and stream.limit == "indent"


def test_past_the_time_allowed_the_first_written_line_ends_the_completion():
    """A llama rigged to answer the hole with four lines, one token each."""
    lines = ["x = 1\n", "y = 2\n", "z = 3\n", "w = 4\n"]
    tokenizer = byte_tokenizer([*QWEN_FIM, *lines])
    model = scripted_model(tokenizer, lines, tokenizer.get_vocab()["<|fim_middle|>"])

    def written(**settings) -> Done:
        engine = Engine(model, tokenizer, "lines", verify_cost=CPU_LIKE_COST)
        return answer(engine, Infill("a = 0\n", "\n"), "none", **settings)

    assert written().text == "".join(lines)
    timed = written(line_seconds=1e-9)
    assert timed.text == "x = 1\n" and timed.record.limit == "time"
    assert timed.record.finish_reason == "stop"
    assert written(line_seconds=60).text == "".join(lines)


# --- the server --------------------------------------------------------------------------


class FimProvider(TinyProvider):
    """TinyProvider's models ("tiny": no FIM tokens) and "coder", which has Qwen's."""

    def __init__(self):
        super().__init__(max_tokens=48, context=CONTEXT)
        defaults = Defaults(max_tokens=48, context=CONTEXT)
        self.models["coder"] = ModelInfo("coder", ("prompt-lookup", "none"), defaults)

    def open(self, name: str):
        if name != "coder":
            return super().open(name)

        class Runtime:
            engine = fim_engine()

            def proposer(self, name: str | None) -> str:
                return "prompt-lookup" if name is None else name

        self.opened.append(Runtime())
        return self.opened[-1]


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    with serving(FimProvider()) as url:
        yield url


# llama.vim's FIM request (ggml-org/llama.vim, autoload/llama.vim, `llama#fim`), as it sends
# it: the hole's line split at the cursor into prefix lines, `prompt` and the suffix.
LLAMA_VIM_FIELDS = [
    "content",
    "timings/prompt_n",
    "timings/prompt_ms",
    "timings/prompt_per_token_ms",
    "timings/prompt_per_second",
    "timings/predicted_n",
    "timings/predicted_ms",
    "timings/predicted_per_token_ms",
    "timings/predicted_per_second",
    "truncated",
    "tokens_cached",
]


def llama_vim_request(prefix: str, middle: str, suffix: str, extra=()) -> dict:
    return {
        "id_slot": 0,
        "input_prefix": prefix,
        "input_suffix": suffix,
        "input_extra": [{"text": text, "filename": name} for name, text in extra],
        "prompt": middle,
        "n_predict": 32,
        "stop": [],
        "n_indent": 0,
        "top_k": 40,
        "top_p": 0.90,
        "samplers": ["top_k", "top_p", "infill"],
        "stream": False,
        "cache_prompt": True,
        "t_max_prompt_ms": 500,
        "t_max_predict_ms": 1000,
        "response_fields": LLAMA_VIM_FIELDS,
        "model": "coder",
    }


# llama.vim's check before it parses a reply (`s:fim_on_response`)
LLAMA_VIM_ACCEPTS = re.compile(r'^\s*\{.*"content"\s*:"', re.DOTALL)

PREFIX = "def greet(name):\n    message = 'hello ' + name\n"
SUFFIX = "\n    return message\n\n\nprint(greet('world'))\n"


def test_llama_vims_request_gets_a_reply_llama_vim_reads(base_url):
    helper = "def helper():\n    pass\n"
    body = llama_vim_request(PREFIX, "    ", SUFFIX, [("util.py", helper)])
    headers = {"Content-Type": "application/json"}  # curl's --header, as llama.vim sends
    response = httpx.post(f"{base_url}/infill", content=json.dumps(body), headers=headers)
    assert response.status_code == 200
    assert LLAMA_VIM_ACCEPTS.match(response.text), response.text[:200]
    reply = response.json()
    assert set(reply) == set(LLAMA_VIM_FIELDS)
    assert reply["timings/predicted_n"] >= 1
    assert reply["tokens_cached"] > reply["timings/prompt_n"]
    infill = Infill(PREFIX, SUFFIX, (ExtraFile("util.py", helper),), "    ")
    expected = answer(fim_engine(), infill, "none", max_tokens=32)
    assert expected.text.startswith(reply["content"])


def test_the_next_keystroke_prefills_only_what_changed(base_url):
    """The same hole a character later: the extra files and the prefix up to the change
    come from the cache; what is prefilled is the changed tail, the suffix and the middle."""
    extra = [("util.py", "def helper():\n    return 42\n" * 8)]
    first = llama_vim_request(PREFIX, "    ret", SUFFIX, extra)
    second = llama_vim_request(PREFIX, "    retu", SUFFIX, extra)
    for body in (first, second):
        body["response_fields"] = None
        body["n_predict"] = 4
    httpx.post(f"{base_url}/infill", json=first, timeout=60).raise_for_status()
    reply = httpx.post(f"{base_url}/infill", json=second, timeout=60).json()
    changed = len(fim_tokenizer().encode("u" + SUFFIX, add_special_tokens=False)) + 2
    assert reply["timings"]["prompt_n"] <= changed + 1, reply["timings"]
    assert reply["timings"]["cache_n"] > 200


def test_a_warm_up_takes_the_extra_files_into_the_cache_and_answers_nothing(base_url):
    extra = [{"filename": "w.py", "text": "WARM = 'up'\n" * 20}]
    warm = {"id_slot": 0, "input_prefix": "", "input_suffix": "", "input_extra": extra}
    warm |= {"prompt": "", "n_predict": 0, "response_fields": [""], "model": "coder"}
    response = httpx.post(f"{base_url}/infill", json=warm, timeout=60)
    assert response.status_code == 200 and response.json() == {}
    hole = {"input_prefix": "x = ", "input_suffix": "\n", "input_extra": extra, "model": "coder"}
    reply = httpx.post(f"{base_url}/infill", json=hole | {"n_predict": 2}, timeout=60).json()
    assert reply["timings"]["cache_n"] > 100


def test_a_newer_request_of_the_same_slot_cancels_the_older_at_once(base_url):
    """The older is a long streamed completion (the tiny llama answers ECHO at length);
    once its first piece is out, a request of the same slot ends it."""
    long = {"prompt": ECHO, "n_predict": 4000, "stream": True, "id_slot": 3, "model": "tiny"}
    lines: list[str] = []

    def run_long():
        with httpx.stream("POST", f"{base_url}/completion", json=long, timeout=60) as response:
            for line in response.iter_lines():
                lines.append(line)

    thread = threading.Thread(target=run_long)
    thread.start()
    while not any(line.startswith("data:") for line in lines) and thread.is_alive():
        threading.Event().wait(0.01)
    newer = {"prompt": "one", "n_predict": 2, "id_slot": 3, "model": "tiny"}
    reply = httpx.post(f"{base_url}/completion", json=newer, timeout=60)
    thread.join(30)
    assert reply.status_code == 200 and not thread.is_alive()
    events = [json.loads(line[5:]) for line in lines if line.startswith("data:")]
    assert events[-1].get("error", {}).get("code") == "cancelled", events[-1].get("stop_type")
    assert len(events) < 1000


def test_completion_streams_llama_cpp_chunks_and_ends_with_the_result(base_url):
    body = {"prompt": ECHO, "n_predict": 12, "stream": True, "model": "coder"}
    with httpx.stream("POST", f"{base_url}/completion", json=body, timeout=60) as response:
        events = [
            json.loads(line[5:]) for line in response.iter_lines() if line.startswith("data:")
        ]
    assert all(event["stop"] is False for event in events[:-1]) and events[-1]["stop"] is True
    text = "".join(event["content"] for event in events)
    assert text == answer(fim_engine(), ECHO, "none", max_tokens=12).text
    assert events[-1]["stop_type"] in ("eos", "limit") and "timings" in events[-1]


def test_suffix_in_openai_completions_fills_the_hole(base_url):
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    got = client.completions.create(
        model="coder", prompt=PREFIX, suffix=SUFFIX, max_tokens=20, temperature=0
    )
    expected = answer(fim_engine(), Infill(PREFIX, SUFFIX), "none", max_tokens=20)
    assert got.choices[0].text == expected.text
    assert got.usage.prompt_tokens == expected.record.prompt_tokens
    plain = client.completions.create(model="coder", prompt=PREFIX, max_tokens=3, echo=True)
    assert plain.choices[0].text.startswith(PREFIX)


def test_fim_requests_to_a_model_without_fim_tokens_are_refused_by_name(base_url):
    infill = httpx.post(
        f"{base_url}/infill", json={"input_prefix": "a", "input_suffix": "b"}, timeout=30
    )
    assert infill.status_code == 400 and "no fill-in-the-middle tokens" in infill.text
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="no fill-in-the-middle tokens"):
        client.completions.create(model="tiny", prompt="a", suffix="b", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="echo: not supported with suffix"):
        client.completions.create(model="coder", prompt="a", suffix="b", echo=True)


# --- editors' own requests, replayed ------------------------------------------------------

EDITORS = json.loads((Path(__file__).parent / "data" / "editors" / "llamacpp.json").read_text())


@pytest.mark.parametrize("client", [name for name in EDITORS if not name.startswith("_")])
def test_editors_llama_cpp_requests_are_served_as_llama_cpp_serves_them(base_url, client):
    """Each editor's body as its source builds it, to the model with FIM tokens: a result
    object (a list of them for n_cmpl), or llama.cpp's stream of chunks ending in one."""
    path, text = EDITORS[client]["path"], json.dumps(EDITORS[client]["body"])
    for name, code in (("PREFIX", PREFIX), ("SUFFIX", SUFFIX)):
        text = text.replace(name, json.dumps(code)[1:-1])
    body = {**json.loads(text), "model": "coder"}
    if not body.get("stream"):
        reply = httpx.post(f"{base_url}{path}", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        results = reply.json() if isinstance(reply.json(), list) else [reply.json()]
        assert len(results) == body.get("n_cmpl", 1)
        assert all(result["stop"] is True and "content" in result for result in results)
        if body["n_predict"] == 0:
            assert results[0]["content"] == "" and results[0]["tokens_predicted"] == 0
        return
    with httpx.stream("POST", f"{base_url}{path}", json=body, timeout=60) as reply:
        assert reply.status_code == 200
        events = [json.loads(line[5:]) for line in reply.iter_lines() if line.startswith("data:")]
    assert events[-1]["stop"] is True and "timings" in events[-1]
    text = "".join(event["content"] for event in events)
    assert not any(marker in text for marker in QWEN_FIM)


def test_batched_infills_are_each_their_plain_greedy_answer():
    """Four holes at once through the continuous batch (one target pass a round for all):
    each completion is what plain greedy decoding writes for it alone."""
    holes = [(f"# {word} {word} {word}\nx = '", f"'\n# {word} {word}\n") for word in "abcd"]
    with serving(FimProvider(), limits=ServerLimits(max_batch=4)) as url:

        def complete(hole):
            body = {"input_prefix": hole[0], "input_suffix": hole[1], "n_predict": 24}
            body |= {"model": "coder", "mlxspec": {"k": 3}}
            return httpx.post(f"{url}/infill", json=body, timeout=120).json()

        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(complete, holes))
    for hole, result in zip(holes, results):
        expected = answer(fim_engine(), Infill(*hole), "none", max_tokens=24)
        assert result["content"] == expected.text
    assert max(len(result["x_mlxspec"]["batch_sizes"]) for result in results) > 2
    assert sum(result["timings"]["draft_n"] for result in results) > 0


def test_a_completion_keeps_the_indentation_it_begins_with():
    """The model's first token may start with a space (a line's indentation at the cursor):
    it is the model's, not the padding a whole text's decoding drops."""
    line = "    return a + b"
    tokenizer = byte_tokenizer([*QWEN_FIM, line])
    model = scripted_model(tokenizer, [line], tokenizer.get_vocab()["<|fim_middle|>"])
    engine = Engine(model, tokenizer, "indent", verify_cost=CPU_LIKE_COST)
    assert answer(engine, Infill("def add(a, b):\n", "\n"), "none").text == line
