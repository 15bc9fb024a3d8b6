"""`mlxspec generate --json-schema FILE / --regex PATTERN`: the answer matches, speculation
gives constrained plain decoding's answer, a thinking model's reasoning stays free, and
bad input is one line before any model loads."""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner
from test_cli import assert_one_line_error
from test_loading import save_tiny_llama
from test_thinking import ANSWER, REASONING, models  # noqa: F401  (a fixture)

from mlxspec.cli import main

PROMPT = "abc abc abc"
CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 2, "maxLength": 6},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "sure": {"type": "boolean"},
    },
    "required": ["city", "unit", "sure"],
    "additionalProperties": False,
}
REGEX = r"(yes|no), because [a-z ]{1,20}\."


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random tiny llama saved as an mlx-lm folder (byte tokenizer, no chat template),
    its verify cost seeded flat so no run calibrates and speculation is always chosen."""
    from mlxspec.decoding.verify_cost import VerifyCost, calibration_key

    root = tmp_path_factory.mktemp("generate-grammar")
    save_tiny_llama(root / "model")
    key = calibration_key(str(root / "model"), "float32")
    flat = VerifyCost({1: 1.0, 64: 1.0}, step_seconds=0.01)
    (root / "cache").mkdir()
    (root / "cache" / "calibration.json").write_text(json.dumps({key: flat.to_json()}))
    return root


def generate(root, *args: str) -> dict:
    """One `generate --json` on the tiny model: its output, read."""
    command = ["generate", PROMPT, "-m", str(root / "model"), "-n", "96", "--json", *args]
    result = CliRunner().invoke(main, command, env={"MLXSPEC_CACHE": str(root / "cache")})
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def schema_file(tmp_path, schema) -> str:
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    return str(path)


def test_json_schema_answer_is_valid_and_is_constrained_plain_decodings(tiny, tmp_path):
    """Raw prompt: the grammar alone. Prompt lookup (forced tokens drafted for free) gives
    token for token what plain decoding under the same grammar gives."""
    schema = schema_file(tmp_path, CITY)
    fast = generate(tiny, "--raw", "--json-schema", schema, "-p", "prompt-lookup")
    plain = generate(tiny, "--raw", "--json-schema", schema, "-p", "none")
    answer = json.loads(fast["text"])
    assert sorted(answer) == ["city", "sure", "unit"], answer
    assert isinstance(answer["city"], str) and 2 <= len(answer["city"]) <= 6
    assert answer["unit"] in ("celsius", "fahrenheit") and isinstance(answer["sure"], bool)
    assert fast["token_ids"] == plain["token_ids"]
    record = fast["record"]
    assert record["grammar"] == "json_schema" and record["proposer"] == "prompt-lookup"
    assert record["grammar_drafted"] > 0 and record["grammar_accepted"] > 0
    assert record["finish_reason"] == "stop"  # the schema closed the answer
    assert plain["record"]["grammar"] == "json_schema"


def test_regex_answer_matches_in_full_through_the_chat_template(tiny):
    """A chat prompt on a model with no thinking markers: the grammar alone, unchanged."""
    out = generate(tiny, "--regex", REGEX)
    assert re.fullmatch(REGEX, out["text"]), out["text"]
    assert out["record"]["grammar"] == "regex"
    plain = generate(tiny, "--regex", REGEX, "-p", "none")
    assert out["token_ids"] == plain["token_ids"]


def thinker(*args: str) -> dict:
    """One `generate --json` on test_thinking's scripted Qwen3 (it thinks, then answers
    'Hello there!'), read."""
    result = CliRunner().invoke(main, ["generate", "Hi", "-m", "thinker", "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_a_thinking_model_reasons_freely_and_the_grammar_holds_its_answer(models):  # noqa: F811
    """The grammar follows the reasoning block: the reasoning is the model's own, the
    answer what the regex allows (not the 'Hello there!' the model would write)."""
    out = thinker("--regex", "Hi!", "-p", "none")
    assert (out["reasoning"], out["text"]) == (REASONING, "Hi!")
    assert thinker("-p", "none")["text"] == ANSWER


def test_a_thinking_model_speculates_to_constrained_plain_decodings_answer(models):  # noqa: F811
    """Its drafter (itself) drafts the end token after the forced "i!" (k fixed: always)."""
    plain = thinker("--regex", "Hi!", "-p", "none")
    assert thinker("--regex", "Hi!", "--k", "2")["token_ids"] == plain["token_ids"]


def bad(tmp_path, name: str) -> list[str]:
    """The options of one bad input (files written under tmp_path)."""
    if name == "missing file":
        return ["--json-schema", str(tmp_path / "absent.json")]
    if name == "a directory":
        return ["--json-schema", str(tmp_path)]
    if name == "both":
        return ["--json-schema", schema_file(tmp_path, CITY), "--regex", "a+"]
    if name == "bad regex":
        return ["--regex", "(yes|no"]
    contents = {
        "not JSON": "{type: object}",
        "not UTF-8": b"\xff\xfe{",
        "not an object": "[1, 2]",
        "unenforceable": json.dumps({"type": "string", "format": "uuid4x"}),
    }[name]
    path = tmp_path / "schema.json"
    path.write_bytes(contents if isinstance(contents, bytes) else contents.encode())
    return ["--json-schema", str(path)]


BAD = {
    "missing file": ["--json-schema", "absent.json", "cannot read"],
    "a directory": ["--json-schema", "cannot read"],
    "not JSON": ["--json-schema", "schema.json", "not valid JSON"],
    "not UTF-8": ["--json-schema", "not a JSON file"],
    "not an object": ["--json-schema", "JSON object", "list"],
    "unenforceable": ["--json-schema", 'cannot enforce "format": "uuid4x"'],
    "bad regex": ["--regex", "unclosed group"],
    "both": ["--json-schema and --regex cannot be used together"],
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_grammar_input_is_one_line_before_any_model_loads(tmp_path, name):
    """An unknown model would be an error too: the grammar's line comes first."""
    command = ["generate", "hi", "-m", "no-such-model", *bad(tmp_path, name)]
    assert_one_line_error(CliRunner().invoke(main, command), *BAD[name])
