"""Aggregate tokens/s of N concurrent clients against `serve --ranks R`: the sharded batch
(`--max-batch N`, one sharded pass a round for all rows) vs one request at a time
(`--max-batch 1`), both plain greedy decoding (proposer none), on the bench's prompts.

    python benchmarks/sharded_batch.py --clients 4 --rows 3x1 3x4 1x1 -n 16

A row RxB is `serve --ranks R --max-batch B` (R = 1: one process, no --ranks); RxB:P
asks for proposer P (default: none, plain decoding).

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

from mlxspec.bench.concurrency import replay, warm_up
from mlxspec.bench.suites import load_suite


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def serve(model: str, ranks: int, max_batch: int, clients: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "mlxspec", "serve", "--model", model, "--port", str(port)]
    command += ["--max-batch", str(max_batch), "--max-waiting", str(4 * clients)]
    if ranks > 1:
        command += ["--ranks", str(ranks), "--collective-timeout", "600"]
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
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--rows", nargs="+", default=["3x1", "3x4", "1x1"], help="RANKSxBATCH")
    parser.add_argument("--suite", default="quick")
    parser.add_argument("-n", "--max-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    prompts = load_suite(args.suite)[: args.clients]
    best: dict[str, float] = {}
    texts: dict[str, list[str]] = {}
    tokens: dict[str, int] = {}
    for turn in range(args.repeats):
        for row in args.rows:
            shape, _, proposer = row.partition(":")
            ranks, max_batch = map(int, shape.split("x"))
            server, url = serve(args.model, ranks, max_batch, args.clients)
            try:
                # A warm-up prompt the replay does not send: a kept row would skip its prefill.
                replay(url, args.model, warm_up(prompts, 1), 1, 2, proposer or "none")
                wall, answers = replay(
                    url, args.model, prompts, args.clients, args.max_tokens, proposer or "none"
                )
            finally:
                stop(server)
            made = sum(answer.tokens for answer in answers)
            rate = made / wall
            print(f"turn {turn + 1} row {row}: {made} tokens in {wall:.1f} s", flush=True)
            best[row] = max(best.get(row, 0.0), rate)
            texts[row] = [answer.text for answer in answers]
            tokens[row] = made
            drafted = sum(answer.record.get("drafted", 0) for answer in answers)
            accepted = sum(answer.record.get("accepted", 0) for answer in answers)
            print(f"  drafted {drafted}, accepted {accepted}", flush=True)
    first = args.rows[0]
    print(f"\n{args.clients} clients, {args.model}, -n {args.max_tokens}")
    print("| ranks x max-batch | tokens | aggregate tok/s | vs first row | answers equal first |")
    print("|---|---|---|---|---|")
    for row in args.rows:
        same = "yes" if texts[row] == texts[first] else "no"
        print(
            f"| {row} | {tokens[row]} | {best[row]:.3f} | {best[row] / best[first]:.2f}x | {same} |"
        )


if __name__ == "__main__":
    main()
