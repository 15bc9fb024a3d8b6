"""The target sharded over local ranks (mlx.launch, ring backend over loopback).

Each test starts real processes with a timeout, so nothing here can hang pytest. The
tiny models are saved in mlx-lm's format so that every rank loads the same files.
Failure tests break one rank on purpose through MLXSPEC_FAULT (see distributed.rank).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest
from lossless import assert_lossless, plain_greedy
from mlx.utils import tree_flatten
from tiny_models import FAMILIES, byte_tokenizer, tiny_model

from mlxspec.distributed.launch import (
    LaunchRequest,
    Outcome,
    launch_command,
    strip_launch_options,
)

PROMPT = "abc abc abc abc abc abc"
QWEN2 = dict(FAMILIES["qwen3"], model_type="qwen2", num_hidden_layers=4, tie_word_embeddings=False)


def save_model(model, config: dict, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps({**config, "eos_token_id": 256}))
    byte_tokenizer()._tokenizer.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A models.toml with a tiny llama (4 query, 2 KV heads) and a tiny qwen2."""
    root = tmp_path_factory.mktemp("distributed")
    llama = tiny_model("llama", seed=3)
    save_model(llama, FAMILIES["llama"], root / "llama")
    from mlx_lm.models import qwen2

    mx.random.seed(4)
    qwen = qwen2.Model(qwen2.ModelArgs.from_dict(QWEN2))
    mx.eval(qwen.parameters())
    save_model(qwen, QWEN2, root / "qwen2")
    (root / "models.toml").write_text(
        'default = "tiny"\n'
        '[models.tiny]\ntarget = "./llama"\n'
        "[models.tiny.proposers.prompt-lookup]\nk_max = 8\n"
        "[models.tiny.proposers.self-spec]\nlayers = 1\nk_max = 4\n"
        '[models.tinyq]\ntarget = "./qwen2"\n'
    )
    return root


def mlxspec(root: Path, *args: str, fault: str = "", timeout: float = 90):
    env = {
        **os.environ,
        "MLXSPEC_MODELS": str(root / "models.toml"),
        "MLXSPEC_CACHE": str(root / "cache"),
        "OPENBLAS_NUM_THREADS": "1",
    }
    env.pop("MLXSPEC_FAULT", None)
    if fault:
        env["MLXSPEC_FAULT"] = fault
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "mlxspec", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    return done, time.monotonic() - start


def generate(root: Path, *args: str, **kwargs):
    done, _ = mlxspec(root, "generate", PROMPT, "--raw", "--json", "-n", "24", *args, **kwargs)
    assert done.returncode == 0, done.stderr
    return {**json.loads(done.stdout), "stderr": done.stderr}


def error_line(done) -> str:
    lines = [line for line in done.stderr.splitlines() if line.startswith("Error: ")]
    assert len(lines) == 1, done.stderr
    return lines[0]


# --- Pure logic: no processes -------------------------------------------------------------------


def test_rank_command_line_drops_only_the_launch_options():
    argv = ["generate", "hi", "--ranks", "3", "--backend=ring", "--parallel", "tensor", "--json"]
    assert strip_launch_options(argv) == ["generate", "hi", "--parallel", "tensor", "--json"]
    command = launch_command(LaunchRequest(3, None, "ring", "tensor", 30.0), ["generate", "hi"])
    assert command[command.index("-n") + 1] == "3"
    assert "MLXSPEC_DISTRIBUTED=ring:tensor:30" in command
    assert command[-4:] == ["-m", "mlxspec", "generate", "hi"]


def test_outcome_names_the_rank_that_died_not_those_stopped_after_it():
    outcome = Outcome(3)
    for line in [
        "\x1emlxspec-rank-exit 2 0\n",
        "\x1b[33m[WARN] Node with rank 1 was killed \x1b[0m\n",
        "\x1b[33m[WARN] Node with rank 0 exited with code -15 \x1b[0m\n",
        "[ring] Socket 5 was closed by the peer\n",
    ]:
        assert not outcome.read(line)
    assert outcome.read("mlxspec: loading\n")
    assert outcome.exit_code() == 1
    assert outcome.message(["mac1", "mac2", "mac3"]) == (
        "rank 1 on mac2 was killed before the answer was complete; every rank stopped"
    )
    # Rank 0 may notice the lost peer before mlx.launch stops it: the cause still wins.
    outcome.read("Error: lost the connection to another rank ([ring] ...); every rank stopped\n")
    outcome.read("\x1b[33m[WARN] Node with rank 2 exited with code 1 \x1b[0m\n")
    assert outcome.message([]).startswith("rank 1 was killed")


# --- Real ranks on tiny models ------------------------------------------------------------------


def reference(folder: Path) -> tuple:
    from mlxspec.loading import load_model

    loaded = load_model(str(folder), progress=False)
    prompt = loaded.tokenizer.encode(PROMPT)
    return loaded.model, prompt, plain_greedy(loaded.model, prompt, 24, {256})


def seed_flat_calibration(root: Path, model: str, ranks: int) -> None:
    """Store a verify-cost curve where extra tokens are free, as a calibration run would.

    The adaptive policy prices drafts by a timed calibration; on a busy machine noise can
    price every draft out and leave nothing to check. With this curve its choice depends
    only on acceptance, so the test is deterministic."""
    from mlxspec.distributed.rank import rank_setup
    from mlxspec.policy import VerifyCost, calibration_key

    key = calibration_key(model, rank_setup("tensor", ranks, "ring"))
    flat = VerifyCost({1: 1.0, 64: 1.0}, step_seconds=0.01)
    (root / "cache").mkdir(exist_ok=True)
    (root / "cache" / "calibration.json").write_text(json.dumps({key: flat.to_json()}))


def test_tensor_parallel_output_equals_one_process_greedy(tiny):
    """Plain decoding, adaptive prompt lookup (rank 0's draft length) and self-spec."""
    model, prompt, expected = reference(tiny / "llama")
    seed_flat_calibration(tiny, "tiny", 2)
    for args in (["none", "--k", "0"], ["prompt-lookup"], ["self-spec", "--k", "3"]):
        got = generate(tiny, "--ranks", "2", "--proposer", *args)
        assert "measuring verify cost" not in got["stderr"]  # the seeded curve was used
        record = got["record"]
        assert (record["ranks"], record["backend"], record["parallel"]) == (2, "ring", "tensor")
        assert record["collective_rounds"] >= 1 and record["allreduces_per_forward"] == 6
        assert_lossless(model, prompt, expected, got["token_ids"], f"2 ranks {args}")
        if args[0] == "prompt-lookup":
            assert record["k_policy"] == "adaptive" and record["accepted"] > 0


def test_pipeline_parallel_where_mlx_lm_has_it(tiny):
    model, prompt, expected = reference(tiny / "qwen2")
    got = generate(tiny, "--model", "tinyq", "--ranks", "2", "--parallel", "pipeline", "--k", "4")
    assert got["record"]["parallel"] == "pipeline"
    assert got["record"]["drafted"] > 0 and got["record"]["verify_steps"] > 0  # it speculated
    assert_lossless(model, prompt, expected, got["token_ids"], "pipeline", got["record"])


def test_impossible_splits_fail_with_one_clear_line(tiny):
    done, _ = mlxspec(tiny, "generate", PROMPT, "--ranks", "3")
    assert done.returncode != 0
    assert "rank counts that work: 1, 2" in error_line(done)
    done, _ = mlxspec(tiny, "generate", PROMPT, "--ranks", "2", "--parallel", "pipeline")
    assert done.returncode != 0
    assert "no pipeline split" in error_line(done)


@pytest.mark.parametrize(
    "fault, message",
    [
        ("trim:1:2", "rank 1 diverged from rank 0 in round 2: cache offset"),
        ("weights:1:0", "differ between ranks: rank(s) 1"),
        ("die:1:2", "rank 1 was killed before the answer was complete"),
    ],
)
def test_a_broken_rank_stops_every_rank_with_one_line(tiny, fault, message):
    done, seconds = mlxspec(
        tiny, "generate", PROMPT, "--raw", "--ranks", "2", "--k", "4", fault=fault, timeout=60
    )
    assert done.returncode != 0
    assert message in error_line(done)
    assert seconds < 45


def test_a_stuck_rank_is_caught_by_the_watchdog(tiny):
    args = ("generate", PROMPT, "--raw", "--ranks", "2", "--k", "4", "--collective-timeout", "3")
    done, seconds = mlxspec(tiny, *args, fault="hang:1:2", timeout=60)
    assert done.returncode != 0
    assert "no progress from the other ranks for 3 s" in error_line(done)
    assert seconds < 30


# --- The real model -----------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_three_ranks_prompt_lookup_matches_one_process(smollm2, tmp_path):
    prompt = "Repeat this list exactly: apples, pears, plums, figs, dates, limes, kiwis."
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    env.pop("MLXSPEC_MODELS", None)
    run = [sys.executable, "-m", "mlxspec", "generate", prompt, "--json", "-n", "16"]
    args = ["--proposer", "prompt-lookup", "--k", "8"]
    three = subprocess.run(
        [*run, *args, "--ranks", "3"], capture_output=True, text=True, env=env, timeout=500
    )
    assert three.returncode == 0, three.stderr
    got = json.loads(three.stdout)
    assert got["record"]["ranks"] == 3 and got["record"]["accepted"] > 0
    messages = [{"role": "user", "content": prompt}]
    tokens = list(
        smollm2.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    )
    reference = plain_greedy(smollm2.model, tokens, 16, set(smollm2.tokenizer.eos_token_ids))
    assert_lossless(smollm2.model, tokens, reference, got["token_ids"], "3 ranks prompt-lookup")
