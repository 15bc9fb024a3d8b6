"""Bad input gets one clear line and a non-zero exit, never a traceback."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from mlxspec.cli import main


@pytest.fixture
def user_models(tmp_path, monkeypatch):
    """Point MLXSPEC_MODELS at a file the test writes."""
    path = tmp_path / "models.toml"
    monkeypatch.setenv("MLXSPEC_MODELS", str(path))
    return path


def run(*args, input=None):
    return CliRunner().invoke(main, list(args), input=input)


def assert_one_line_error(result, *needles):
    assert result.exit_code != 0
    assert "Traceback" not in result.output
    error_lines = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(error_lines) == 1, result.output
    for needle in needles:
        assert needle in error_lines[0], error_lines[0]


BAD_INPUT = [
    (["generate", "hi", "--model", "no-such-model"], ["unknown model 'no-such-model'"]),
    (["generate", "hi", "--proposer", "telepathy"], ["unknown proposer 'telepathy'"]),
    (["generate", "hi", "--max-tokens", "0"], ["--max-tokens"]),
    (["generate", "hi", "--max-tokens", "-5"], ["--max-tokens"]),
    (["generate", "hi", "--temperature", "warm"], ["--temperature", "warm"]),
    (["generate", "hi", "--temperature", "-1"], ["--temperature"]),
    (["generate", "hi", "--top-p", "0"], ["--top-p"]),
    (["generate", "   "], ["prompt is empty"]),
    (["pull", "no-such-model"], ["unknown model"]),
    (["serve", "--chat-template-args", "{enable_thinking: false}"], ["not valid JSON"]),
    (["serve", "--chat-template-args", "[1]"], ["must be a JSON object", "[1]"]),
]


@pytest.mark.parametrize("args,needles", BAD_INPUT, ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_bad_input_is_one_clear_line(args, needles):
    assert_one_line_error(run(*args), *needles)


def test_broken_models_toml_names_the_file(user_models):
    user_models.write_text("[models.x\ntarget = 1\n")
    result = run("generate", "hi")
    assert_one_line_error(result, str(user_models))
    assert_one_line_error(run("models"), str(user_models))


def test_unreadable_weights_directory(user_models, tmp_path):
    empty = tmp_path / "weights"
    empty.mkdir()
    user_models.write_text(f'default = "broken"\n[models.broken]\ntarget = "{empty}"\n')
    assert_one_line_error(run("generate", "hi"), str(empty))


def test_unreachable_hub_repo_says_what_to_do(user_models, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    user_models.write_text('default = "remote"\n[models.remote]\ntarget = "nobody/no-such-repo"\n')
    assert_one_line_error(run("generate", "hi"), "nobody/no-such-repo")


def test_models_lists_the_registry_as_json():
    result = run("models", "--json")
    assert result.exit_code == 0, result.output
    listing = json.loads(result.output)
    names = {row["name"] for row in listing["models"]}
    assert "smollm2-135m" in names
    default = next(row for row in listing["models"] if row["default"])
    assert "prompt-lookup" in default["proposers"] and "none" in default["proposers"]
    assert listing["machine"]["blas"]


def test_every_command_has_help_with_an_example():
    for command in ["generate", "models", "pull", "train-drafter"]:
        result = run(command, "--help")
        assert result.exit_code == 0
        assert "Example" in result.output and "mlxspec" in result.output


def test_serve_on_a_busy_port_fails_before_loading(monkeypatch):
    """A second server on the same port: one line, before any weights load and before
    "serving" is printed (it used to load the model, say "serving", then die)."""
    import socket

    import mlxspec.registry.runtime

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded although the port is busy")

    monkeypatch.setattr(mlxspec.registry.runtime, "open_runtime", no_loading)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run("serve", "--port", str(port))
    assert_one_line_error(result, f"127.0.0.1:{port}", "--port")
    assert "serving" not in result.output


@pytest.mark.parametrize("found", [False, True], ids=["reference-blas", "openblas"])
def test_reference_blas_gets_one_line_with_the_fix(monkeypatch, tmp_path, found):
    """Without OpenBLAS the policy rightly drafts nothing; the user is told why, once."""
    from mlxspec import blas

    monkeypatch.setattr(blas, "blas_in_use", "OpenBLAS (x)" if found else blas.NO_OPENBLAS)
    result = run("generate", "hi", "--model", str(tmp_path / "absent"))
    hint_lines = [line for line in result.output.splitlines() if "reference BLAS" in line]
    assert len(hint_lines) == (0 if found else 1), result.output
    if not found:
        assert "apt install libopenblas0-pthread" in hint_lines[0]


def test_model_takes_a_local_mlx_lm_folder(tmp_path, monkeypatch):
    """What an mlx-lm user types: a folder saved by mlx-lm, with no models.toml entry."""
    from test_loading import save_tiny_llama

    monkeypatch.setenv("MLXSPEC_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "my-model"
    folder.mkdir()
    save_tiny_llama(folder)
    result = CliRunner().invoke(
        main, ["generate", "abc abc abc", "-m", str(folder), "-n", "4", "--raw", "--json"]
    )
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)["record"]
    assert record["model"] == str(folder) and record["proposer"] == "prompt-lookup"
    assert record["completion_tokens"] == 4


def test_model_path_that_does_not_exist_says_so(tmp_path):
    assert_one_line_error(
        run("generate", "hi", "-m", str(tmp_path / "nowhere")), "nowhere", "does not exist"
    )
    assert_one_line_error(run("generate", "hi", "-m", "./nowhere.gguf"), "does not exist")


def test_hub_id_offline_fails_fast_with_true_advice(monkeypatch):
    """No network here: one line, in seconds, advising a local path (which works, above)."""
    import time

    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    started = time.perf_counter()
    result = run("generate", "hi", "-m", "mlx-community/no-such-model-for-mlxspec-tests")
    assert_one_line_error(result, "cannot reach the Hugging Face hub", "pass a local path")
    assert time.perf_counter() - started < 30


def test_mistyped_proposer_names_the_model_and_the_closest_name():
    result = run("generate", "hi", "--proposer", "prompt-lokup")
    assert_one_line_error(
        result, "'prompt-lokup'", "'smollm2-135m'", "available:", "did you mean 'prompt-lookup'"
    )
    assert "models.toml" not in result.output  # the file is fine; the flag is misspelt


def test_history_of_a_model_named_by_hub_id(tmp_path, monkeypatch):
    """`run/serve --model owner/name` keep that model's history: `history` shows it too."""
    from mlxspec.suffix.store import history_store

    monkeypatch.setenv("MLXSPEC_DATA", str(tmp_path))
    history_store("someone/some-model").add([1, 2, 3, 4])
    result = run("history", "--model", "someone/some-model", "--json")
    assert result.exit_code == 0, result.output
    facts = json.loads(result.output)
    assert facts["model"] == "someone/some-model" and facts["documents"] == 1


def test_history_clear_in_a_folder_that_cannot_be_used(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("MLXSPEC_DATA", str(blocker))
    assert_one_line_error(run("history", "--clear"), "cannot clear", str(blocker))
