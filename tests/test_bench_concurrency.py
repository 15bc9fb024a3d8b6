"""`mlxspec bench --concurrency`: N clients against the real in-process server.

The tiny llama of test_bench behind uvicorn; the rows must really share target passes
(mean batch > 1) and every greedy answer, batched or mlx-lm's, must equal the
one-at-a-time server's.
"""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner
from test_bench import (
    PROMPTS,
    TINY_MODELS,
    make_entry,
    make_runtime,
    one_error_line,
    record_calibrations,
)

import mlxspec.registry.runtime
from mlxspec.batch.width import ROW_FLOOR
from mlxspec.bench.client import Answer
from mlxspec.bench.concurrency import (
    ANCHOR,
    BATCHED_PLAIN,
    ServedRow,
    pace_by_class,
    percentile,
    run_served,
    served_rows,
    summarize,
)
from mlxspec.bench.suites import BenchPrompt
from mlxspec.cli import main

FOUR = [*PROMPTS, BenchPrompt("tail", "copy", "x y z x y z x y"), PROMPTS[0]]


@pytest.fixture
def four_prompts(tmp_path, monkeypatch):
    """`mlxspec bench --model tiny --prompts four.jsonl` on the tiny runtime."""
    record_calibrations(monkeypatch)
    runtime = make_runtime(make_entry(tmp_path), tmp_path, monkeypatch)
    models = tmp_path / "models.toml"
    models.write_text(TINY_MODELS)
    monkeypatch.setenv("MLXSPEC_MODELS", str(models))
    monkeypatch.setattr(mlxspec.registry.runtime, "open_runtime", lambda entry, notify: runtime)
    path = tmp_path / "four.jsonl"
    path.write_text("".join(json.dumps({"prompt": p.text, "class": p.kind}) + "\n" for p in FOUR))
    return ["bench", "--model", "tiny", "--prompts", str(path), "--max-tokens", "10"]


def test_rows_share_passes_and_every_answer_equals_one_at_a_time(four_prompts, tmp_path):
    out = tmp_path / "concurrency.json"
    args = [*four_prompts, "-c", "2", "--proposers", "prompt-lookup", "--json", str(out)]
    result = CliRunner().invoke(main, [*args, "--repeats", "2"])
    assert result.exit_code == 0, result.output
    assert "batched plain, 4 requests (repeat 2/2)" in result.output  # rows took turns
    rows = json.loads(out.read_text())["rows"]  # each row once: its faster repeat
    assert [r["row"] for r in rows] == [
        "one at a time (prompt-lookup)",
        "batched plain",
        "batched + prompt-lookup",
        ANCHOR,
    ]
    for row in rows:
        assert row["requests"] == len(FOUR) and row["tokens"] > 0
        assert row["equal"] == len(FOUR), row  # greedy: batched and mlx-lm == one at a time
    alone, plain, lookup = rows[:3]
    assert alone["mean_batch"] == 1.0
    assert plain["mean_batch"] > 1.2 and lookup["mean_batch"] > 1.2  # rounds were shared
    assert plain["acceptance"] is None and lookup["acceptance"] > 0
    assert alone["ttft_p95"] >= alone["ttft_p50"] > 0
    assert "| 2 | batched + prompt-lookup |" in result.output
    assert set(lookup["pace_vs_plain_by_class"]) == {p.kind for p in FOUR}
    assert "Decode speed per prompt class" in result.output


def test_concurrency_refuses_options_it_cannot_honour(four_prompts):
    result = CliRunner().invoke(main, [*four_prompts, "-c", "2", "--tree"])
    assert result.exit_code == 2
    assert "--concurrency draws no plot and runs lines only" in result.output


def test_an_unknown_proposer_is_one_line_before_the_weights_load(four_prompts, monkeypatch):
    def no_loading(entry, notify):
        raise AssertionError("the weights loaded before the names were checked")

    monkeypatch.setattr(mlxspec.registry.runtime, "open_runtime", no_loading)
    result = CliRunner().invoke(main, [*four_prompts, "-c", "2", "--proposers", "prompt-lookp"])
    assert result.exit_code == 1
    assert "unknown proposer 'prompt-lookp'" in one_error_line(result)


def answer(sent: float, first: float, done: float, tokens: int, text: str = "a") -> Answer:
    return Answer("p", text, sent, first, done, {"completion_tokens": tokens, "batch_sizes": []})


def test_latency_pace_and_request_speedup_are_what_the_client_saw():
    slow = [answer(0.0, 2.0, 6.0, 5), answer(0.0, 1.0, 2.0, 3)]
    fast = [answer(0.0, 0.5, 2.5, 5), answer(1.0, 1.5, 2.0, 3, text="b")]
    row = summarize("fast", 2, wall=4.0, answers=fast, reference=slow)
    assert row["tokens_per_second"] == 8 / 4.0
    assert row["per_token_p50"] == 0.25 and row["per_token_p95"] == 0.5  # (2.5-.5)/4, .5/2
    assert row["ttft_p50"] == 0.5 and row["mean_latency"] == (2.5 + 1.0) / 2
    assert row["request_speedup_p50"] == 2.0  # 6/2.5 = 2.4 and 2/1 = 2: nearest rank
    assert row["equal"] == 1  # the second answer's text differs


def test_decode_speed_by_class_is_the_median_pace_ratio_per_class():
    prompts = [BenchPrompt(str(i), kind, "x") for i, kind in enumerate("aaab")]
    plain = [answer(0.0, 1.0, 1.0 + 0.1 * 4, 5) for _ in prompts]  # 0.1 s between tokens
    paces = [0.05, 0.1, 0.025, 0.2]  # class a: 2x, 1x, 4x; class b: 0.5x
    here = [answer(0.0, 1.0, 1.0 + pace * 4, 5) for pace in paces]
    assert pace_by_class(prompts, here, plain) == pytest.approx({"a": 2.0, "b": 0.5})


def test_percentile_is_nearest_rank():
    assert percentile([], 0.5) is None
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.95) == 4.0


def test_each_row_floor_gets_its_own_batched_rows_and_needs_concurrency(four_prompts):
    rows = served_rows(4, "prompt-lookup", ["prompt-lookup"], (ROW_FLOOR, 0.0))
    assert [(r.label, r.row_floor) for r in rows[2:]] == [
        ("batched + prompt-lookup", ROW_FLOOR),
        ("batched + prompt-lookup (row floor 0)", 0.0),
    ]
    result = CliRunner().invoke(main, [*four_prompts, "--row-floor", "0"])
    assert result.exit_code == 2
    assert "--row-floor goes with --concurrency" in result.output


def test_the_warm_up_leaves_no_replayed_prompt_for_a_batch_to_reuse(tmp_path, monkeypatch):
    """A batched server keeps its finished rows for prefix reuse; warmed up with the very
    prompts it then replays, it skipped their prefill, which the one-at-a-time row and
    mlx-lm pay. No replayed request may reuse more than the chat template they share."""
    record_calibrations(monkeypatch)
    runtime = make_runtime(make_entry(tmp_path), tmp_path, monkeypatch)
    prompts = [*PROMPTS, BenchPrompt("tail", "copy", "x y z x y z x y")]
    ids = [runtime.engine.encode_chat([{"role": "user", "content": p.text}]) for p in prompts]
    shared = len(os.path.commonprefix(ids))
    row = ServedRow(BATCHED_PLAIN, max_batch=2, proposer="none")
    _, answers = run_served(runtime, row, prompts, clients=2, max_tokens=6)
    reused = [a.record["reused_prompt_tokens"] for a in answers]
    assert max(reused) <= shared, (reused, shared)
