"""Measure the suffix history's index: build, draft-round lookup and load times.

    python benchmarks/suffix_index.py --tokens 10000000

A synthetic stream of Zipf-distributed token ids (SmolLM2's vocabulary size) cut into
documents of ~600 tokens, with every 4th document repeating pieces of earlier ones (so
long matches exist). A "round" is what the proposer does: the longest match of a
32-token context, then the continuations of up to 32 occurrences, 16 deep.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from mlxspec.proposers.base import ProposalContext
from mlxspec.proposers.suffix import SuffixProposer
from mlxspec.suffix.index import SENTINEL, PrefixIndex, sort_positions
from mlxspec.suffix.store import HistoryStore, _encode

VOCAB = 49152


def synthetic_stream(n_tokens: int, rng: np.random.Generator) -> np.ndarray:
    tokens = (rng.zipf(1.2, n_tokens) % VOCAB).astype(np.int32)
    starts = np.arange(0, n_tokens, 600)
    for start in starts[3::4]:  # a copy of an earlier stretch, as a repeated request would
        source = int(rng.integers(0, max(1, start - 600)))
        tokens[start : start + 300] = tokens[source : source + 300][
            : len(tokens[start : start + 300])
        ]
    tokens[starts] = SENTINEL
    tokens[0] = SENTINEL
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=10_000_000)
    parser.add_argument("--rounds", type=int, default=2000)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    tokens = synthetic_stream(args.tokens, rng)

    start = time.perf_counter()
    order = sort_positions(tokens)
    print(f"build from scratch: {time.perf_counter() - start:.1f} s for {args.tokens:,} tokens")
    index = PrefixIndex(tokens, order)

    contexts = []
    for _ in range(args.rounds):
        end = int(rng.integers(64, len(tokens)))
        context = tokens[end - 32 : end].tolist()
        if rng.random() < 0.5:  # half the rounds: a context never seen (a fresh request)
            context[-int(rng.integers(2, 6)) :] = rng.integers(0, VOCAB, 1).tolist() * 1
        contexts.append([t if t != SENTINEL else 7 for t in context])
    times, cpu_times, lengths = [], [], []
    for context in contexts:
        start, cpu_start = time.perf_counter(), time.thread_time()
        length, lo, hi = index.longest_match(context)
        for position in index.occurrences(lo, hi, 32).tolist():
            index.tokens[position + 1 : position + 17].tolist()
        times.append(time.perf_counter() - start)
        cpu_times.append(time.thread_time() - cpu_start)
        lengths.append(length)
    # Wall time includes waiting for a core on a shared machine; CPU time does not.
    for label, seconds in (("wall", times), ("cpu", cpu_times)):
        ms = np.array(seconds) * 1000
        print(
            f"draft round ({label}): median {np.median(ms):.3f} ms, "
            f"p99 {np.percentile(ms, 99):.3f} ms, max {ms.max():.3f} ms"
        )
    print(f"mean match length {np.mean(lengths):.1f} tokens")

    # A whole proposer round: the request's own index (a 1,000-token request), the
    # history's, and the frequency-scored tree of the continuations (16 deep, 32 nodes).
    with tempfile.TemporaryDirectory() as folder:
        store = HistoryStore(Path(folder))
        store._index = index  # the index measured above, as if loaded
        proposer = SuffixProposer(store=store)
        request = tokens[1000:2000].tolist()
        round_times = []
        for context in contexts[:500]:
            ctx = ProposalContext([t for t in request if t != SENTINEL] + context, None, None, None)
            proposer.reset()
            proposer.situation(ctx)  # first sight of the request: its index is built
            start = time.thread_time()
            if proposer.situation(ctx) is not None:
                proposer.propose_tree(ctx, 16, 32)
            round_times.append(time.thread_time() - start)
        ms = np.array(round_times) * 1000
        print(
            f"proposer round (cpu): median {np.median(ms):.3f} ms, "
            f"p99 {np.percentile(ms, 99):.3f} ms, max {ms.max():.3f} ms"
        )

    document = tokens[1:601].tolist()
    start = time.perf_counter()
    index.add_document(document)
    print(f"insert one 600-token request: {(time.perf_counter() - start) * 1000:.0f} ms")

    with tempfile.TemporaryDirectory() as folder:
        bound = 64 * 2**20
        index.drop_oldest(bound // 8)
        Path(folder, "index.bin").write_bytes(_encode(index))
        size = Path(folder, "index.bin").stat().st_size
        loads = []
        for _ in range(3):
            store = HistoryStore(Path(folder), bound)
            start = time.perf_counter()
            n_loaded = len(store.index)
            loads.append(time.perf_counter() - start)
        print(
            f"load at the 64 MB bound ({size / 2**20:.1f} MB, {n_loaded:,} tokens): "
            f"best {min(loads):.3f} s of 3"
        )


if __name__ == "__main__":
    main()
