"""A soak of `mlxspec serve`: a bounded run under a mix of dialects, streams, disconnects,
forced tool calls and JSON schemas, at a concurrency above the server's slots.

Starts `serve` (or uses --url), first answers each distinct request alone (greedy: the
reference), then runs --clients client threads for --minutes, each sending requests drawn
from the mix in turn: OpenAI chat (plain, streamed, a forced tool call, a JSON schema),
text completions, Anthropic messages (plain, streamed), the Responses API (plain,
streamed), and clients that leave (a timeout before the first byte, or a stream closed
after a few chunks). Reports requests served, refused (and whether each refusal carried
Retry-After), failed, answers that differ from their one-at-a-time reference, and the
server's resident memory at the start, the middle and the end. Every request goes to this
machine's loopback only, and the run stops by itself.

    python benchmarks/soak.py --minutes 10            # SmolLM2, 8 slots, 24 clients
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
from serving import start_serve

PROMPTS = [
    "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog.",
    "List three colours, one a line.",
    "What is the capital of France?",
    "Write the numbers one to ten, separated by commas.",
]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
        },
    },
}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
MAX_TOKENS = 32


def requests_mix() -> list[tuple[str, str, dict]]:
    """(kind, path, body) of every request the soak sends; all greedy."""
    mix = []
    for prompt in PROMPTS:
        chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS}
        chat["temperature"] = 0
        mix.append(("chat", "/v1/chat/completions", chat))
        mix.append(("chat-stream", "/v1/chat/completions", {**chat, "stream": True}))
        mix.append(
            (
                "completion",
                "/v1/completions",
                {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0},
            )
        )
        messages = {
            "model": "default",
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "messages": [{"role": "user", "content": prompt}],
        }
        mix.append(("messages", "/v1/messages", messages))
        mix.append(("messages-stream", "/v1/messages", {**messages, "stream": True}))
        responses = {"input": prompt, "max_output_tokens": MAX_TOKENS, "temperature": 0}
        mix.append(("responses", "/v1/responses", responses))
        mix.append(("responses-stream", "/v1/responses", {**responses, "stream": True}))
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    mix.append(
        (
            "tool-call",
            "/v1/chat/completions",
            {
                "messages": ask,
                "tools": [WEATHER],
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            },
        )
    )
    mix.append(
        (
            "json-schema",
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "Invent a person."}],
                "temperature": 0,
                "max_tokens": MAX_TOKENS,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "person", "schema": PERSON},
                },
            },
        )
    )
    return mix


def answer_of(kind: str, reply: httpx.Response) -> str:
    """The answer's text (or calls), from a whole reply or a whole stream."""
    if not kind.endswith("stream"):
        body = reply.json()
        if kind in ("chat", "tool-call", "json-schema"):
            message = body["choices"][0]["message"]
            calls = [
                (c["function"]["name"], c["function"]["arguments"])
                for c in message.get("tool_calls") or []
            ]
            return json.dumps([message.get("content"), calls])
        if kind == "completion":
            return body["choices"][0]["text"]
        if kind == "messages":
            return "".join(block.get("text", "") for block in body["content"])
        return "".join(
            part["text"]
            for item in body["output"]
            if item["type"] == "message"
            for part in item["content"]
        )
    text = []
    for line in reply.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if kind == "chat-stream" and event.get("choices"):
            text.append(event["choices"][0]["delta"].get("content") or "")
        elif kind == "messages-stream" and event.get("type") == "content_block_delta":
            text.append(event["delta"].get("text", ""))
        elif kind == "responses-stream" and event.get("type") == "response.output_text.delta":
            text.append(event["delta"])
    joined = "".join(text)
    return json.dumps([joined, []]) if kind == "chat-stream" else joined


def reference_kind(kind: str) -> str:
    return kind.removesuffix("-stream")


def resident_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    status = Path(f"/proc/{pid}/status")
    for line in status.read_text().splitlines() if status.exists() else ():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=24)
    parser.add_argument("--url", help="a running serve (default: start one)")
    parser.add_argument("--serve-args", default="", help="extra `mlxspec serve` options")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="the counts as JSON")
    args = parser.parse_args()
    serve, pid, url = None, None, args.url
    if url is None:
        serve, url = start_serve(args.serve_args)
        pid = serve.pid
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    mix = [(kind, path, {**body, "model": model}) for kind, path, body in requests_mix()]
    try:
        reference = {}
        for kind, path, body in mix:  # one at a time: what each answer must be
            if not kind.endswith("stream"):
                reply = httpx.post(url + path, json=body, timeout=300)
                reply.raise_for_status()
                reference[
                    (
                        reference_kind(kind),
                        json.dumps(
                            body["messages"]
                            if "messages" in body
                            else body.get("prompt") or body.get("input")
                        ),
                    )
                ] = answer_of(kind, reply)
        counts: Counter = Counter()
        differing: list[str] = []
        failures: list[str] = []
        memory = {"start": resident_mb(pid)}
        deadline = time.monotonic() + args.minutes * 60
        halfway = time.monotonic() + args.minutes * 30
        lock = threading.Lock()

        def client(index: int) -> None:
            rng = random.Random(args.seed * 1000 + index)
            while time.monotonic() < deadline:
                kind, path, body = rng.choice(mix)
                leave = rng.random() < 0.15
                try:
                    if leave and rng.random() < 0.5:
                        with httpx.stream(
                            "POST", url + path, json={**body, "stream": True}, timeout=300
                        ) as reply:
                            # three events of its answer: a queued stream's comments
                            # (": waiting in queue") come first and do not count
                            events = (
                                x for x in reply.iter_lines() if x.startswith(("data:", "event:"))
                            )
                            for _, _line in zip(range(3), events):
                                pass
                        outcome = "left mid-stream"
                    elif leave:
                        try:
                            httpx.post(url + path, json=body, timeout=0.2)
                        except httpx.TimeoutException:
                            pass
                        outcome = "left before its first byte"
                    else:
                        reply = httpx.post(url + path, json=body, timeout=600)
                        if reply.status_code in (429, 529):
                            retry = "with" if reply.headers.get("retry-after") else "WITHOUT"
                            outcome = f"refused {retry} Retry-After"
                        elif reply.status_code != 200:
                            outcome = f"failed {reply.status_code}"
                            with lock:  # what the server said, to find why
                                failures.append(f"{kind} {path}: {reply.text[:300]}")
                        else:
                            outcome = "served"
                            key = (
                                reference_kind(kind),
                                json.dumps(
                                    body["messages"]
                                    if "messages" in body
                                    else body.get("prompt") or body.get("input")
                                ),
                            )
                            if answer_of(kind, reply) != reference[key]:
                                with lock:
                                    differing.append(kind)
                except httpx.HTTPError as err:
                    outcome = f"failed {type(err).__name__}"
                with lock:
                    counts[outcome] += 1
                    if "middle" not in memory and time.monotonic() > halfway:
                        memory["middle"] = resident_mb(pid)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        time.sleep(2)
        memory["end"] = resident_mb(pid)
        health = httpx.get(f"{url}/health").json()
    finally:
        if serve is not None:
            serve.terminate()
            serve.wait(60)
    result = {
        "minutes": args.minutes,
        "clients": args.clients,
        "outcomes": dict(counts),
        "differing": len(differing),
        "differing_kinds": dict(Counter(differing)),
        "failures": failures[:10],
        "resident_mb": memory,
        "health_after": {k: health.get(k) for k in ("active", "waiting", "busy")},
    }
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
