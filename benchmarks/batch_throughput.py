"""Aggregate tokens/s of N concurrent greedy requests: batched (one target pass a round)
vs one at a time, plain and with prompt lookup, on the bench's own prompts.

    python benchmarks/batch_throughput.py --model smollm2-135m --concurrency 4 8 \
        --proposers none prompt-lookup

Every row runs in this one process, so compare ratios within a run. The verify-cost
calibration and a warm-up run come first; each row alternates the two ways `--repeat`
times and keeps the best of each (a shared machine's load swings). Each batched answer
is compared with the same request run alone (greedy: equal, or a near tie).
"""

from __future__ import annotations

import argparse
import time

from mlxspec.batch.scheduler import Scheduler
from mlxspec.bench.suites import load_suite
from mlxspec.decoding.engine import Engine, GenerationSettings
from mlxspec.events import Done
from mlxspec.models.loading import load_model
from mlxspec.proposers import PromptLookup


def one_at_a_time(engine: Engine, prompts, settings, proposer) -> tuple[float, list]:
    start, answers = time.perf_counter(), []
    for prompt in prompts:
        engine.reset()  # no prompt reuse between requests, as in the batch
        done = [e for e in engine.stream(prompt, settings, proposer) if isinstance(e, Done)]
        answers.append(done[0].token_ids)
    return time.perf_counter() - start, answers


def batched(engine: Engine, prompts, settings, proposer, max_batch: int) -> tuple[float, list]:
    scheduler = Scheduler(engine, max_batch)
    start = time.perf_counter()
    ids = [scheduler.submit(p, settings, proposer) for p in prompts]
    answers: dict[int, tuple] = {}
    for out in scheduler.drain():
        for request_id, events in out.items():
            if isinstance(events[-1], Done):
                answers[request_id] = events[-1].token_ids
    return time.perf_counter() - start, [answers[i] for i in ids]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--proposers", nargs="+", default=["none", "prompt-lookup"])
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    loaded = load_model(args.model)
    engine = Engine(loaded.model, loaded.tokenizer, args.model, [PromptLookup()])
    suite = load_suite("all")
    engine.verify_cost  # noqa: B018  (calibrate now, not inside a timed row)
    warm = [[{"role": "user", "content": suite[0].text}]]
    batched(engine, warm * 2, GenerationSettings(max_tokens=8), "prompt-lookup", 2)
    print("| N | proposer | one at a time tok/s | batched tok/s | ratio | answers equal |")
    print("| --- | --- | --- | --- | --- | --- |")
    for n in args.concurrency:
        spread = [suite[i * len(suite) // n] for i in range(n)]  # code, QA, chat, summaries
        prompts = [[{"role": "user", "content": p.text}] for p in spread]
        for proposer in args.proposers:
            settings = GenerationSettings(
                max_tokens=args.max_tokens, k=0 if proposer == "none" else None
            )
            alone_s = batch_s = float("inf")
            for _ in range(args.repeat):
                seconds, alone = one_at_a_time(engine, prompts, settings, proposer)
                alone_s = min(alone_s, seconds)
                seconds, together = batched(engine, prompts, settings, proposer, n)
                batch_s = min(batch_s, seconds)
            alone_rate = sum(map(len, alone)) / alone_s
            batch_rate = sum(map(len, together)) / batch_s
            same = sum(a == b for a, b in zip(alone, together))
            print(
                f"| {n} | {proposer} | {alone_rate:.1f} | {batch_rate:.1f} | "
                f"{batch_rate / alone_rate:.2f} | {same}/{n} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
