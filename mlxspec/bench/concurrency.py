"""`mlxspec bench --concurrency N`: N clients at once against the real server, in process.

Each row starts the API server (uvicorn, the worker thread, SSE) on a loopback port over
the runtime already loaded, and N client threads replay the suite: each takes the next
prompt as soon as its previous answer ends (a closed loop, as editors and agents do),
streaming greedy chat completions. Rows, in one run on the same weights:

- one at a time: `--max-batch 1` with the model's default proposer (the server before
  batching);
- batched plain: `--max-batch N`, no drafts;
- batched + P: `--max-batch N` with proposer P, for each batchable proposer asked for;
- mlx-lm `batch_generate`: mlx-lm's own batched decoding of the same prompt ids with
  N sequences at a time, no server (the anchor: what plain batching costs in mlx-lm).

Aggregate tokens/s is every answer's tokens over the row's wall time. Time to first
token and the pace after it (seconds between tokens) are per request, as the client
saw them (queueing included); a request's speedup is its latency in the first row over
its latency here. Greedy answers are compared with the first row's. With `--repeats R`
the rows take turns R times and each keeps its fastest turn.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from mlxspec.batch.rows import unbatchable_reason
from mlxspec.batch.target import capture_unsupported
from mlxspec.batch.width import ROW_FLOOR
from mlxspec.bench import BenchError
from mlxspec.bench.client import Answer, RequestFailed, stream_chat
from mlxspec.bench.report import markdown_table, number_cell
from mlxspec.bench.suites import BenchPrompt
from mlxspec.markup.chat_template import encode_chat
from mlxspec.registry.models_toml import NONE
from mlxspec.registry.runtime import Runtime
from mlxspec.server import ServerLimits, create_app
from mlxspec.server.background import serving_in_thread
from mlxspec.server.providers import OpenedProvider

REQUEST_TIMEOUT = 600.0  # seconds a client waits for one answer before the row fails
WARM_UP_TOKENS = 4
WARM_UP_LINE = "(A warm-up request: its answer is not timed.)"
ANCHOR = "mlx-lm batch_generate"
BATCHED_PLAIN = "batched plain"
BATCHED_WITH = "batched + "  # and the proposer's name


@dataclass(frozen=True)
class ServedRow:
    label: str
    max_batch: int
    proposer: str  # a proposer of the entry, or "none"
    row_floor: float = ROW_FLOOR  # serve --row-floor


def served_rows(
    clients: int, default: str, proposers: list[str], floors: tuple[float, ...] = (ROW_FLOOR,)
) -> list[ServedRow]:
    """The server before batching, batched plain, then batched with each proposer at
    each row floor (labelled when it is not serve's default)."""
    rows = [ServedRow(f"one at a time ({default})", 1, default)]
    rows.append(ServedRow(BATCHED_PLAIN, clients, NONE))
    for floor in floors:
        note = "" if floor == ROW_FLOOR else f" (row floor {floor:g})"
        rows += [
            ServedRow(BATCHED_WITH + name + note, clients, name, floor)
            for name in proposers
            if name != NONE
        ]
    return rows


def batchable(runtime: Runtime, names: list[str]) -> tuple[list[str], dict[str, str]]:
    """The proposers a batch can run, and why each other one cannot (it would run alone,
    which is the one-at-a-time row again)."""
    kept, refused = [], {}
    cannot = capture_unsupported(runtime.engine.target.model)  # the same for every name
    for name in names:
        built = runtime.engine.proposers.get(runtime.proposer(name))
        reason = unbatchable_reason(built, cannot) if built is not None else None
        if reason:
            refused[name] = reason
        else:
            kept.append(name)
    return kept, refused


def replay(
    base_url: str,
    model: str,
    prompts: list[BenchPrompt],
    clients: int,
    max_tokens: int,
    proposer: str,
) -> tuple[float, list[Answer]]:
    """Every prompt once, `clients` at a time; wall seconds and the answers in order."""
    work: queue.Queue[tuple[int, BenchPrompt]] = queue.Queue()
    for item in enumerate(prompts):
        work.put(item)
    answers: list[Answer | None] = [None] * len(prompts)
    failures: list[str] = []

    def client() -> None:
        while not failures:
            try:
                index, prompt = work.get_nowait()
            except queue.Empty:
                return
            body = {
                "model": model,
                "messages": [{"role": "user", "content": prompt.text}],
                "max_tokens": max_tokens,
                "temperature": 0,
                "mlxspec": {"proposer": proposer, "history": False},
            }
            try:
                answers[index] = stream_chat(base_url, prompt.id, body, REQUEST_TIMEOUT)
            except (RequestFailed, OSError) as err:
                failures.append(f"{prompt.id}: {err}")

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    if failures:
        raise BenchError(f"a request failed ({failures[0]})")
    return wall, [answer for answer in answers if answer is not None]


def run_served(
    runtime: Runtime,
    row: ServedRow,
    prompts: list[BenchPrompt],
    clients: int,
    max_tokens: int,
) -> tuple[float, list[Answer]]:
    """One row: a fresh server with the row's batch size, warmed up, then the replay."""
    entry = runtime.entry
    limits = ServerLimits(
        max_tokens=max_tokens,
        max_waiting=len(prompts) + clients,
        max_batch=row.max_batch,
        row_floor=row.row_floor,
    )
    app = create_app(OpenedProvider(runtime, entry), limits=limits)
    with serving_in_thread(app) as url:
        replay(url, entry.name, warm_up(prompts, clients), clients, WARM_UP_TOKENS, row.proposer)
        return replay(url, entry.name, prompts, clients, max_tokens, row.proposer)


def warm_up(prompts: list[BenchPrompt], clients: int) -> list[BenchPrompt]:
    """The first `clients` prompts, each opened by a line of its own, so that no warm-up
    cache holds a replayed prompt: a batched server keeps its last rows for prefix reuse
    and would skip those prompts' prefill, which the one-at-a-time server and mlx-lm
    pay (seen: 8 of 17 prompts, ~7 s of a 38 s run, 2.06x one at a time instead of
    ~1.7x)."""
    return [
        replace(p, id=f"warm-up-{p.id}", text=f"{WARM_UP_LINE}\n\n{p.text}")
        for p in prompts[:clients]
    ]


def run_anchor(
    runtime: Runtime, prompts: list[BenchPrompt], clients: int, max_tokens: int
) -> tuple[float, list[str], int]:
    """mlx-lm's `batch_generate` on the same prompt ids: wall seconds, texts, tokens."""
    from mlx_lm.generate import batch_generate

    model, tokenizer = runtime.loaded.model, runtime.loaded.tokenizer
    ids = [
        encode_chat(tokenizer, [{"role": "user", "content": p.text}], generation_prompt=True)
        for p in prompts
    ]
    sizes = dict(completion_batch_size=clients, prefill_batch_size=clients)
    batch_generate(model, tokenizer, ids[:clients], max_tokens=WARM_UP_TOKENS, **sizes)
    start = time.perf_counter()
    response = batch_generate(
        model, tokenizer, ids, max_tokens=max_tokens, return_token_ids=True, **sizes
    )
    wall = time.perf_counter() - start
    return wall, list(response.texts), sum(map(len, response.token_ids))


def percentile(values: list[float], fraction: float) -> float | None:
    """Nearest-rank percentile (no interpolation: a handful of requests per row)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


def summarize(
    label: str, clients: int, wall: float, answers: list[Answer], reference: list[Answer]
) -> dict[str, Any]:
    """A served row's numbers; request speedups and equal answers are against `reference`."""
    tokens = sum(answer.tokens for answer in answers)
    drafted = sum(answer.record.get("drafted", 0) for answer in answers)
    accepted = sum(answer.record.get("accepted", 0) for answer in answers)
    first = [a.time_to_first_token for a in answers if a.time_to_first_token is not None]
    pace = [a.per_token for a in answers if a.per_token is not None]
    rounds = [0] * (clients + 1)
    for answer in answers:
        for size, count in enumerate(answer.record.get("batch_sizes", [])):
            rounds[min(size, clients)] += count
    return {
        "row": label,
        "clients": clients,
        "requests": len(answers),
        "tokens": tokens,
        "seconds": wall,
        "tokens_per_second": tokens / wall,
        "ttft_p50": percentile(first, 0.5),
        "ttft_p95": percentile(first, 0.95),
        "per_token_p50": percentile(pace, 0.5),
        "per_token_p95": percentile(pace, 0.95),
        "mean_latency": sum(a.latency for a in answers) / len(answers),
        "request_speedup_p50": percentile(
            [ref.latency / a.latency for ref, a in zip(reference, answers)], 0.5
        ),
        "acceptance": accepted / drafted if drafted else None,
        "mean_batch": (
            sum(size * count for size, count in enumerate(rounds)) / sum(rounds)
            if sum(rounds)
            else 1.0
        ),
        "equal": sum(ref.text == a.text for ref, a in zip(reference, answers)),
        "near_ties": sum(answer.record.get("near_ties", 0) for answer in answers),
    }


def pace_by_class(
    prompts: list[BenchPrompt], answers: list[Answer], plain: list[Answer]
) -> dict[str, float]:
    """Per prompt class, the median over its requests of (seconds between tokens in the
    batched plain row / here): how much faster speculation decodes each class inside the
    batch. Aggregate tokens/s cannot say it, as one batch mixes the classes."""
    ratios: dict[str, list[float]] = {}
    for prompt, answer, base in zip(prompts, answers, plain):
        if answer.per_token and base.per_token:
            ratios.setdefault(prompt.kind, []).append(base.per_token / answer.per_token)
    return {kind: percentile(values, 0.5) for kind, values in sorted(ratios.items())}


def summarize_anchor(
    clients: int, wall: float, texts: list[str], tokens: int, reference: list[Answer]
) -> dict[str, Any]:
    return {
        "row": ANCHOR,
        "clients": clients,
        "requests": len(texts),
        "tokens": tokens,
        "seconds": wall,
        "tokens_per_second": tokens / wall,
        "equal": sum(ref.text == text for ref, text in zip(reference, texts)),
    }


def run_concurrency(
    runtime: Runtime,
    prompts: list[BenchPrompt],
    levels: list[int],
    proposers: list[str],
    max_tokens: int,
    notify: Callable[[str], None],
    repeats: int = 1,
    floors: tuple[float, ...] = (ROW_FLOOR,),
) -> dict[str, Any]:
    """Every row at every concurrency level, all rows in turn `repeats` times (each keeps
    its fastest); the result document's rows."""
    kept, refused = batchable(runtime, proposers)
    for name, reason in refused.items():
        notify(f"skipping {name} in the batched rows: {reason}")
    default = runtime.proposer(None)
    runtime.engine.verify_cost  # noqa: B018  (calibrate now, not inside a timed row)
    rows: list[dict[str, Any]] = []
    for clients in levels:
        # Per row, its fastest repeat: a shared machine's load only ever slows a row
        # down, so the fastest repeat is the least disturbed one.
        served: dict[str, tuple[float, list[Answer]]] = {}
        anchor: tuple[float, list[str], int] | None = None
        for repeat in range(repeats):
            turn = f" (repeat {repeat + 1}/{repeats})" if repeats > 1 else ""
            for row in served_rows(clients, default, kept, floors):
                notify(f"{clients} clients: {row.label}, {len(prompts)} requests{turn}")
                wall, answers = run_served(runtime, row, prompts, clients, max_tokens)
                if row.label not in served or wall < served[row.label][0]:
                    served[row.label] = (wall, answers)
            notify(f"{clients} clients: {ANCHOR}{turn}")
            measured = run_anchor(runtime, prompts, clients, max_tokens)
            anchor = measured if anchor is None or measured[0] < anchor[0] else anchor
        reference = next(iter(served.values()))[1]  # the one-at-a-time row's answers
        plain = served[BATCHED_PLAIN][1]
        for label, (wall, answers) in served.items():
            rows.append(summarize(label, clients, wall, answers, reference))
            if label.startswith(BATCHED_WITH):
                rows[-1]["pace_vs_plain_by_class"] = pace_by_class(prompts, answers, plain)
        rows.append(summarize_anchor(clients, *anchor, reference))
    return {"rows": rows, "skipped": refused, "repeats": repeats, "row_floors": list(floors)}


def concurrency_markdown(result: dict[str, Any]) -> str:
    """One table: a row per (clients, method), ratios against the first row of each level."""
    header = [
        "clients",
        "row",
        "tok/s",
        "x one at a time",
        "TTFT p50 / p95 s",
        "per token p50 / p95 ms",
        "mean latency s",
        "request speedup p50",
        "acceptance",
        "mean batch",
        "equal",
    ]
    base: dict[int, float] = {}
    body = []
    for row in result["rows"]:
        rate = row["tokens_per_second"]
        base.setdefault(row["clients"], rate)
        body.append(
            [
                str(row["clients"]),
                row["row"],
                f"{rate:.1f}",
                f"{rate / base[row['clients']]:.2f}x",
                _pair(row.get("ttft_p50"), row.get("ttft_p95"), 1.0, ".2f"),
                _pair(row.get("per_token_p50"), row.get("per_token_p95"), 1000.0, ".0f"),
                number_cell(row.get("mean_latency"), ".1f"),
                number_cell(row.get("request_speedup_p50"), ".2f", "x"),
                number_cell(row.get("acceptance"), ".0%"),
                number_cell(row.get("mean_batch"), ".1f"),
                f"{row['equal']}/{row['requests']}",
            ]
        )
    lines = markdown_table(header, body)
    lines += _class_table(result["rows"])
    for name, reason in result.get("skipped", {}).items():
        lines.append(f"\n{name} is not in the batched rows: {reason}.")
    return "\n".join(lines)


def _pair(low: float | None, high: float | None, scale: float, spec: str) -> str:
    if low is None or high is None:
        return number_cell(None, spec)
    return f"{low * scale:{spec}} / {high * scale:{spec}}"


def _class_table(rows: list[dict[str, Any]]) -> list[str]:
    """Each speculative row's decode speed per prompt class, against batched plain."""
    speculative = [row for row in rows if row.get("pace_vs_plain_by_class")]
    if not speculative:
        return []
    kinds = sorted({kind for row in speculative for kind in row["pace_vs_plain_by_class"]})
    body = [
        [str(row["clients"]), row["row"]]
        + [number_cell(row["pace_vs_plain_by_class"].get(kind), ".2f", "x") for kind in kinds]
        for row in speculative
    ]
    intro = "\nDecode speed per prompt class, x batched plain (median over its requests):\n"
    return [intro, *markdown_table(["clients", "row", *kinds], body)]
