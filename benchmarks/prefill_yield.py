"""A long prompt joining a running batch: the running rows' pace while it prefills.

    python benchmarks/prefill_yield.py --prompt 20000 --chunk 512

Two rows decode plain (k = 0) in a `Scheduler` of four slots; then a request with a
`--prompt`-token prompt joins, prefilled `--chunk` tokens a round beside them (the
scheduler's own chunking). Prints the running rows' time a round before the join, during
it (median and worst) and after, and the long prompt's prefill time against the same
prompt prefilled alone. A random llama (mlx-lm's class, hidden 256 x 4 layers), so that
20k tokens fit and the numbers are the scheduler's, not a real model's quality.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import mlxspec  # noqa: F401  (OpenBLAS before mlx.core on Linux)

# isort: split
import mlx.core as mx
from mlx_lm.models import llama

from mlxspec.batch.scheduler import Scheduler
from mlxspec.decoding.engine import Engine
from mlxspec.decoding.verify_cost import VerifyCost
from mlxspec.settings import GenerationSettings

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from tiny_models import VOCAB, byte_tokenizer  # noqa: E402

CONFIG = dict(
    model_type="llama",
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=512,
    rms_norm_eps=1e-5,
    vocab_size=VOCAB,
    max_position_embeddings=65536,
    tie_word_embeddings=False,
)


def round_times(scheduler: Scheduler, rounds: int) -> list[float]:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        scheduler.step()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=20000)
    parser.add_argument("--chunk", type=int, default=512)
    args = parser.parse_args()
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(CONFIG))
    mx.eval(model.parameters())
    tokenizer = byte_tokenizer()
    tokenizer.eos_token_ids = []  # every row generates what it was asked for
    engine = Engine(model, tokenizer, "random", verify_cost=VerifyCost({1: 1.0, 2: 1.1}, 0.05))
    rng = random.Random(0)
    long = [rng.randrange(1, 256) for _ in range(args.prompt)]
    # The long prompt alone, for its prefill time.
    alone = Scheduler(engine, max_batch=1)
    alone.prefill_chunk = args.chunk
    start = time.perf_counter()
    alone.submit(long, GenerationSettings(max_tokens=1, k=0, context=args.prompt + 8))
    list(alone.drain())
    alone_s = time.perf_counter() - start
    engine.prompt_cache.clear()

    scheduler = Scheduler(engine, max_batch=4)
    scheduler.prefill_chunk = args.chunk
    settings = GenerationSettings(max_tokens=100000, k=0, context=args.prompt * 2)
    for _ in range(2):
        scheduler.submit([rng.randrange(1, 256) for _ in range(64)], settings)
    round_times(scheduler, 10)  # both running
    before = round_times(scheduler, 30)
    joined = scheduler.submit(long, GenerationSettings(max_tokens=1, k=0, context=args.prompt + 8))
    during, start = [], time.perf_counter()
    while any(slot.request_id == joined for slot in [*scheduler.waiting, *scheduler.joining]):
        during += round_times(scheduler, 1)
    joined_s = time.perf_counter() - start
    after = round_times(scheduler, 30)
    ms = lambda xs: f"{1000 * statistics.median(xs):.1f} ms"  # noqa: E731
    print(f"running rows, a round (one token each): before {ms(before)}, after {ms(after)}")
    print(
        f"  while a {args.prompt}-token prompt joins in {args.chunk}-token chunks: "
        f"median {ms(during)}, worst {1000 * max(during):.1f} ms, {len(during)} rounds"
    )
    print(f"its prefill: {joined_s:.1f} s beside them, {alone_s:.1f} s alone")


if __name__ == "__main__":
    main()
