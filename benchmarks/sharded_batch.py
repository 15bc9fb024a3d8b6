"""Aggregate tokens/s of N concurrent clients against `serve --ranks R`: the sharded batch
(`--max-batch N`, one sharded pass a round for all rows) vs one request at a time
(`--max-batch 1`), both plain greedy decoding (proposer none), on the bench's prompts.

    python benchmarks/sharded_batch.py --ranks 3 --clients 4 --max-batch 1 4 -n 16

`bench --concurrency` serves in its own process and refuses `--ranks`; this script starts
the real sharded server (`mlxspec serve --ranks R`) once per row and replays the prompts
with the bench's own client (`mlxspec.bench.concurrency.replay`): every client takes the
next prompt as soon as its answer ends. Rows take turns `--repeats` times and keep their
fastest turn (a shared machine's load swings); answers are compared across rows.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

import httpx

from mlxspec.bench.concurrency import replay
from mlxspec.bench.suites import load_suite


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def serve(model: str, ranks: int, max_batch: int, clients: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "mlxspec", "serve", "--model", model, "--port", str(port)]
    command += ["--ranks", str(ranks), "--max-batch", str(max_batch)]
    command += ["--max-waiting", str(4 * clients), "--collective-timeout", "600"]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, env=os.environ)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while True:
        if server.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the server did not come up: {command}")
        try:
            if httpx.get(f"{url}/health").json().get("model") == model:
                return server, url
        except httpx.HTTPError:
            pass
        time.sleep(1)


def stop(server: subprocess.Popen) -> None:
    server.send_signal(signal.SIGINT)
    try:
        server.wait(60)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--max-batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--suite", default="quick")
    parser.add_argument("-n", "--max-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    prompts = load_suite(args.suite)[: args.clients]
    best: dict[int, float] = {}
    texts: dict[int, list[str]] = {}
    tokens: dict[int, int] = {}
    for turn in range(args.repeats):
        for max_batch in args.max_batch:
            server, url = serve(args.model, args.ranks, max_batch, args.clients)
            try:
                replay(url, args.model, prompts[:1], 1, 2, "none")  # warm-up
                wall, answers = replay(
                    url, args.model, prompts, args.clients, args.max_tokens, "none"
                )
            finally:
                stop(server)
            made = sum(answer.tokens for answer in answers)
            rate = made / wall
            print(f"turn {turn + 1} --max-batch {max_batch}: {made} tokens in {wall:.1f} s")
            best[max_batch] = max(best.get(max_batch, 0.0), rate)
            texts[max_batch] = [answer.text for answer in answers]
            tokens[max_batch] = made
    base = best[args.max_batch[0]]
    print(f"\n{args.clients} clients, {args.ranks} ranks, {args.model}, -n {args.max_tokens}")
    print("| --max-batch | tokens | aggregate tok/s | vs first row | answers equal first row |")
    print("|---|---|---|---|---|")
    first = texts[args.max_batch[0]]
    for max_batch in args.max_batch:
        same = "yes" if texts[max_batch] == first else "no"
        print(
            f"| {max_batch} | {tokens[max_batch]} | {best[max_batch]:.3f} "
            f"| {best[max_batch] / base:.2f}x | {same} |"
        )


if __name__ == "__main__":
    main()
