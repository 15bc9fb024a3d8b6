"""What mlxspec's own loop costs on top of the passes, where a pass is cheap: a tiny random
llama (mlx-lm's classes, the tests' byte tokenizer), greedy, no drafts but in `lookup`.

    python benchmarks/host_overhead.py                      # every part, 5 repeats
    python benchmarks/host_overhead.py --part single --profile

- single: `Engine.stream` at k = 0 against mlx-lm's `generate_step` on the same model and
  prompt, `--tokens` tokens, at each `--shape` (hidden size x layers); ms a token and the
  ratio of tokens/s (mlxspec / mlx-lm).
- batch: the scheduler's batched plain (`Scheduler(engine, C)`, what `serve --max-batch C`
  and `bench -c C`'s "batched plain" row run, without the server) against mlx-lm's
  `batch_generate` at C sequences at a time, `--prompts` prompts of mixed lengths; and
  both against the bare passes (`bare_passes`: the same left-padded prefills and one-token
  passes pipelined as mlx-lm pipelines them, no scheduling, no reads but the tokens): what
  the passes alone cost (a side that pads its prefill less may beat it).
- lookup: C requests with adaptive prompt lookup, one at a time (`Engine.stream`, what a
  server with `--max-batch 1` runs) against batched (`Scheduler(engine, C)`), and the
  batch with prompt lookup against batched plain.

Every row runs in this one process on a shared machine: the sides take turns `--repeats`
times (their order rotating) and each keeps its fastest turn; the median turn is printed
beside it. Every side generates every token asked for (EOS off); a line says so where
their tokens differ (on a GPU, a batch may round apart at near ties). A last line per
part gives each side's host work: its main thread's CPU time a token (Python, graph
building, MLX's dispatch), which the CPU backend's pass, computed on other threads, hides
here and a GPU's cheap pass would not. `--profile` runs mlxspec's side of each part once
more under cProfile and prints where its host time went.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import mlxspec  # noqa: F401  (preloads OpenBLAS before mlx.core on Linux)

# isort: split
import mlx.core as mx
from mlx_lm.generate import batch_generate, generate_step
from mlx_lm.models.cache import BatchKVCache

from mlxspec.decoding.engine import Engine
from mlxspec.decoding.verify_cost import VerifyCost
from mlxspec.events import Done
from mlxspec.proposers import PromptLookup
from mlxspec.settings import GenerationSettings

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from batch_throughput import batched, one_at_a_time  # noqa: E402  (the scheduler drains)
from tiny_models import FAMILIES, byte_tokenizer, tiny_model  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog. "


def tiny_llama(hidden: int, layers: int, measured: bool = False):
    """A random llama of `hidden` x `layers` (4x wide MLP, 4 heads, 2 KV heads) and an
    engine over it. Unless `measured`, its fixed verify cost skips calibration (k = 0
    never uses it); measured, the engine times its curve and pass grid, as a server's
    does, for drafting that prices its passes (with prompt lookup)."""
    config = dict(FAMILIES["llama"], hidden_size=hidden, intermediate_size=4 * hidden)
    model = tiny_model("llama", config=config, layers=layers)
    tokenizer = byte_tokenizer()
    tokenizer.eos_token_ids = []  # both sides generate every token asked for
    if measured:
        return model, tokenizer, Engine(model, tokenizer, "tiny-llama", [PromptLookup()])
    engine = Engine(model, tokenizer, "tiny-llama", verify_cost=VerifyCost({1: 1.0}, 1.0))
    return model, tokenizer, engine


def mlxspec_single(engine: Engine, prompt: list[int], tokens: int) -> tuple[float, tuple]:
    engine.reset()  # no prompt reuse: mlx-lm prefills too
    settings = GenerationSettings(max_tokens=tokens, k=0)
    start = time.perf_counter()
    done = [e for e in engine.stream(prompt, settings) if isinstance(e, Done)][0]
    return time.perf_counter() - start, done.token_ids


def mlx_lm_single(model, prompt: list[int], tokens: int) -> tuple[float, tuple]:
    start = time.perf_counter()
    out = tuple(token for token, _ in generate_step(mx.array(prompt), model, max_tokens=tokens))
    return time.perf_counter() - start, out


def batch_prompts(count: int) -> list[list[int]]:
    """Prompts of 20-120 bytes: rows of a batch start and end at different rounds."""
    return [list((PROMPT * 4)[: 20 + (37 * i) % 100].encode()) for i in range(count)]


def mlxspec_batched(
    engine: Engine, prompts, tokens: int, clients: int, proposer: str | None = None
) -> tuple[float, list]:
    """The scheduler's batch, plain (k = 0) or drafting with `proposer` (adaptive k),
    from a cold engine: no prompt reuse, nothing its policies learned in earlier turns
    (as `one_at_a_time` starts each request)."""
    engine.reset()
    settings = GenerationSettings(max_tokens=tokens, k=None if proposer else 0)
    return batched(engine, prompts, settings, proposer, clients)


def mlx_lm_batched(model, tokenizer, prompts, tokens: int, clients: int) -> tuple[float, list]:
    sizes = dict(completion_batch_size=clients, prefill_batch_size=clients)
    start = time.perf_counter()
    response = batch_generate(
        model, tokenizer, prompts, max_tokens=tokens, return_token_ids=True, **sizes
    )
    return time.perf_counter() - start, [tuple(ids) for ids in response.token_ids]


def bare_passes(model, prompts: list[list[int]], tokens: int, clients: int) -> tuple[float, list]:
    """The passes alone: `clients` prompts at a time left-padded into one prefill over
    mlx-lm's `BatchKVCache`, then `tokens` one-token passes, each built on the last one's
    lazy argmax and `async_eval`ed before that token is read (mlx-lm's pipelining). No
    scheduling, joins or events: what the two sides' passes cost with nothing around
    them. (It assumes every prompt of a group ends together, as here with EOS off.)"""
    start, answers = time.perf_counter(), []
    for first in range(0, len(prompts), clients):
        group = prompts[first : first + clients]
        longest = max(map(len, group))
        padding = [longest - len(p) for p in group]
        caches = [BatchKVCache(padding) for _ in model.layers]
        inputs = mx.array([[0] * pad + p for pad, p in zip(padding, group)])
        token = mx.argmax(model(inputs, cache=caches)[:, -1], axis=-1)
        mx.async_eval(token)
        columns = []
        for _ in range(tokens):
            following = mx.argmax(model(token[:, None], cache=caches)[:, -1], axis=-1)
            mx.async_eval(following)
            columns.append(token.tolist())
            token = following
        answers.extend(tuple(row) for row in zip(*columns))
    return time.perf_counter() - start, answers


def take_turns(
    *sides: Callable[[], tuple[float, object]], repeats: int
) -> tuple[list[list[float]], list[list[float]]]:
    """Each side's turns: wall seconds, and main-thread CPU seconds (the host's own work:
    Python, building graphs, MLX's dispatch; the CPU backend computes on other threads,
    so this is what a GPU's cheap pass would leave exposed where here the pass hides it).
    The order rotates; where the sides' outputs differ, a line says so."""
    for run in sides:  # warm-up: kernels, buffers
        run()
    seconds: list[list[float]] = [[] for _ in sides]
    host: list[list[float]] = [[] for _ in sides]
    differed = False
    for turn in range(repeats):
        order = list(range(len(sides)))
        order = order[turn % len(order) :] + order[: turn % len(order)]
        if turn % 2:
            order.reverse()
        outputs = {}
        for side in order:
            cpu = time.thread_time()
            wall, outputs[side] = sides[side]()
            host[side].append(time.thread_time() - cpu)
            seconds[side].append(wall)
        if len({repr(outputs[side]) for side in outputs}) > 1 and not differed:
            # Same work either way (EOS off); on a GPU a batch's rows may round apart at a
            # random tiny model's near ties, so say it once and go on timing.
            differed = True
            print("note: the sides' tokens differ (rounding at a near tie?)", flush=True)
    return seconds, host


def report_host(tokens: int, names: list[str], host: list[list[float]]) -> None:
    """Each side's main-thread CPU a token, median turn (`take_turns`' second list)."""
    shares = ", ".join(
        f"{name} {1000 * statistics.median(cpu) / tokens:.3f}" for name, cpu in zip(names, host)
    )
    print(f"  host work (main-thread CPU, median turn), ms/token: {shares}", flush=True)


def report(
    label: str, tokens: int, mine: list[float], other: list[float], names=("mlxspec", "mlx-lm")
) -> None:
    """ms a token of each side's fastest turn, and the ratio of tokens/s (the first side
    over the second) three ways: fastest turns, median turns, and the median over pairs
    of adjacent turns (the steadiest where the machine's load drifts)."""
    fast = min(other) / min(mine)
    typical = statistics.median(other) / statistics.median(mine)
    paired = statistics.median(theirs / ours for ours, theirs in zip(mine, other))
    print(
        f"{label}: {names[0]} {1000 * min(mine) / tokens:.2f} ms/token, "
        f"{names[1]} {1000 * min(other) / tokens:.2f} ms/token; tokens/s ratio "
        f"{fast:.2f}x (fastest turns), {typical:.2f}x (median), {paired:.2f}x (median pair)",
        flush=True,
    )


def single(shapes: list[tuple[int, int]], tokens: int, repeats: int, profile: bool) -> None:
    prompt = list(PROMPT.encode())
    for hidden, layers in shapes:
        model, _, engine = tiny_llama(hidden, layers)
        (mine, other), host = take_turns(
            partial(mlxspec_single, engine, prompt, tokens),
            partial(mlx_lm_single, model, prompt, tokens),
            repeats=repeats,
        )
        report(f"single, hidden {hidden} x {layers} layers, {tokens} tokens", tokens, mine, other)
        report_host(tokens, ["mlxspec", "mlx-lm"], host)
        if profile:
            print_profile(partial(mlxspec_single, engine, prompt, tokens))


def batch(
    hidden: int, layers: int, prompts: int, clients: int, tokens: int, repeats: int, profile: bool
) -> None:
    model, tokenizer, engine = tiny_llama(hidden, layers)
    asked = batch_prompts(prompts)
    ours = partial(mlxspec_batched, engine, asked, tokens, clients)
    (mine, other, bare), host = take_turns(
        ours,
        partial(mlx_lm_batched, model, tokenizer, asked, tokens, clients),
        partial(bare_passes, model, asked, tokens, clients),
        repeats=repeats,
    )
    label = f"batch of {clients}, hidden {hidden} x {layers} layers, {prompts} prompts"
    report(f"{label} x {tokens} tokens", prompts * tokens, mine, other)
    report("  against the bare passes", prompts * tokens, mine, bare, ("mlxspec", "bare"))
    report("  against the bare passes", prompts * tokens, other, bare, ("mlx-lm", "bare"))
    report_host(prompts * tokens, ["mlxspec", "mlx-lm", "bare"], host)
    if profile:
        print_profile(ours)


def lookup(
    hidden: int, layers: int, clients: int, tokens: int, repeats: int, profile: bool
) -> None:
    """`clients` requests with adaptive prompt lookup: batched against one at a time,
    and against batched plain. The engine measures its curve and pass grid first."""
    _, _, engine = tiny_llama(hidden, layers, measured=True)
    asked = batch_prompts(clients)
    ours = partial(mlxspec_batched, engine, asked, tokens, clients, "prompt-lookup")
    (together, alone, plain), host = take_turns(
        ours,
        partial(
            one_at_a_time, engine, asked, GenerationSettings(max_tokens=tokens), "prompt-lookup"
        ),
        partial(mlxspec_batched, engine, asked, tokens, clients),
        repeats=repeats,
    )
    label = f"{clients} requests with prompt lookup, hidden {hidden} x {layers} layers"
    names = ("batched", "one at a time")
    report(f"{label} x {tokens} tokens", clients * tokens, together, alone, names)
    report("  against batched plain", clients * tokens, together, plain, ("batched", "plain"))
    report_host(clients * tokens, ["batched", "one at a time", "plain"], host)
    if profile:
        print_profile(ours)


def print_profile(run: Callable[[], object]) -> None:
    """Where one more of mlxspec's turns spends its time, by function (own time first:
    the waits for MLX show as the caller of `mx.eval`, `async_eval` or `.item()`)."""
    profiler = cProfile.Profile()
    profiler.runcall(run)
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


def shape(text: str) -> tuple[int, int]:
    hidden, layers = text.split("x")
    return int(hidden), int(layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["single", "batch", "lookup", "all"], default="all")
    parser.add_argument("--shape", type=shape, nargs="+", default=[(256, 4), (64, 2)])
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--batch-tokens", type=int, default=64)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    hidden, layers = args.shape[0]
    if args.part in ("single", "all"):
        single(args.shape, args.tokens, args.repeats, args.profile)
    if args.part in ("lookup", "all"):
        lookup(hidden, layers, args.clients, args.batch_tokens, args.repeats, args.profile)
    if args.part in ("batch", "all"):
        batch(
            hidden,
            layers,
            args.prompts,
            args.clients,
            args.batch_tokens,
            args.repeats,
            args.profile,
        )


if __name__ == "__main__":
    main()
