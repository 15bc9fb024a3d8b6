"""Agents' sessions replayed against the real `mlxspec serve` and mlx-lm's own server:
what a next turn costs once the earlier ones were prefilled (issue 61).

Each session starts from a request a real agent sent (tests/data/agents/: Claude Code,
Codex, Qwen Code; their system prompts and tool descriptions as text, slimmed to fit an
8k context) and grows as the agent grows it: each next turn appends the answer it got
and a tool result (a slice of one of this repository's source files). opencode's title
request, a side request under another system prompt, is sent between turns as opencode
sends it. Every request is a streamed chat completion at temperature 0, so both servers
get the very same messages (the later turns carry mlxspec's answers) and render them
through the same chat template.

Per turn it records prompt tokens, the tokens the prompt cache held (usage's
`prompt_tokens_details.cached_tokens`), the time to the first token, and two yardsticks:
the time to prefill only the turn's new tokens onto a cache holding the rest, timed in
this process after the servers stopped (what a perfect prompt cache leaves to do: the
goal's denominator), and the time to prefill the same number of fresh tokens alone
through /v1/completions (no context to attend to: cheaper still). Before the last turn
it stops `serve` (its caches go to disk) and starts it again. mlx-lm's server (its LRU
prompt cache, no speculation) answers the same requests in the same run, on the same
folder, with the same BLAS.

Models: SmolLM2-135M (the default model, converted once to an mlx-lm folder) and two
random models of the cache kinds that reused nothing before: a hybrid Gated DeltaNet
one (qwen3_5) and a sliding-window one (gemma3_text), each with SmolLM2's tokenizer.

    python benchmarks/agent_replay.py                       # all three, 4 turns each
    python benchmarks/agent_replay.py --models qwen3_5 --turns 3 --out replay.json
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

import mlxspec  # noqa: F401  (OpenBLAS before mlx.core on Linux, for the in-process timings)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving import free_port, start_serve  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "data" / "agents"
AGENTS = {
    "claude-code": "claude-code-2.1.332.messages.json",
    "codex": "codex-0.171.0.responses.json",
    "qwen-code": "qwen-code-0.24.4.chat.json",
}
SIDE = "opencode-1.18.33.title.chat.json"
SYSTEM_CHARS = 9000  # of each agent's system prompt and tool descriptions: ~2.5k tokens
RESULT_CHARS = 1600  # a tool result: ~450 tokens
MAX_TOKENS = 48
# Random models of the cache kinds issue 61 measured, big enough that a prefill costs
# more than the HTTP round trip (SmolLM2's vocabulary, so its tokenizer serves them).
RANDOM = {
    "qwen3_5": dict(
        model_type="qwen3_5",
        hidden_size=256,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=512,
        rms_norm_eps=1e-6,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
        full_attention_interval=4,
        tie_word_embeddings=True,
        rope_parameters={"type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25},
        max_position_embeddings=8192,
    ),
    "gemma3_text": dict(
        model_type="gemma3_text",
        hidden_size=256,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=64,
        intermediate_size=512,
        sliding_window=512,
        sliding_window_pattern=4,
        query_pre_attn_scalar=64,
        max_position_embeddings=8192,
    ),
}


def text_of(content) -> str:
    """A message's text, whatever the dialect's shape (string, blocks, input items)."""
    if isinstance(content, str):
        return content
    parts = []
    for block in content or []:
        if isinstance(block, dict):
            parts.append(block.get("text") or block.get("input_text") or "")
    return "\n".join(p for p in parts if p)


def tools_text(tools: list[dict]) -> str:
    lines = ["You can call these tools:"]
    for tool in tools:
        spec = tool.get("function", tool)
        lines.append(f"- {spec.get('name')}: {(spec.get('description') or '')[:300]}")
    return "\n".join(lines)


def first_request(agent: str) -> list[dict]:
    """The agent's first request as chat messages: its system prompt and tools as text,
    its user turn, each slimmed to fit."""
    body = json.loads((FIXTURES / AGENTS[agent]).read_text())["body"]
    system, users = [], []
    if "system" in body:
        system.append(text_of(body["system"]))
    for item in body.get("messages", []) + body.get("input", []):
        role, text = item.get("role"), text_of(item.get("content"))
        (system if role in ("system", "developer") else users).append(text)
    system.append(tools_text(body.get("tools", [])))
    prompt = "\n\n".join(system)[:SYSTEM_CHARS]
    return [
        {"role": "system", "content": prompt},
        {"role": "user", "content": "\n".join(users)[-1500:]},
    ]


def side_request() -> list[dict]:
    body = json.loads((FIXTURES / SIDE).read_text())["body"]
    return [{"role": m["role"], "content": text_of(m["content"])} for m in body["messages"]]


def tool_result(rng: random.Random) -> str:
    files = sorted((ROOT / "mlxspec").rglob("*.py"))
    text = rng.choice(files).read_text()
    start = rng.randrange(max(1, len(text) - RESULT_CHARS))
    return "Tool result:\n" + text[start : start + RESULT_CHARS]


PROPOSER: str | None = None  # --proposer: what mlxspec's requests ask for (None: the default)
SERVE_ARGS = ""  # --serve-args: more `mlxspec serve` options


def ask(url: str, messages: list[dict], max_tokens: int | None = None) -> dict:
    """One streamed chat completion: its text, usage, time to first token and in all."""
    body = {  # no model named: each server's own (mlx-lm's reads a name as a path)
        **({"mlxspec": {"proposer": PROPOSER}} if PROPOSER else {}),
        "messages": messages,
        "max_tokens": max_tokens or MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start, first, text, usage = time.perf_counter(), None, [], {}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=900) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    first = first or time.perf_counter()
                    text.append(piece)
    end = time.perf_counter()
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    decoding = end - (first or end)
    tokens = usage.get("completion_tokens") or 0
    return {
        "tokens_per_s": round((tokens - 1) / decoding, 1) if decoding > 0 and tokens > 1 else None,
        "text": "".join(text),
        "prompt_tokens": usage.get("prompt_tokens"),
        "cached_tokens": cached,
        "completion_tokens": usage.get("completion_tokens"),
        "ttft_s": round((first or end) - start, 3),
        "total_s": round(end - start, 3),
    }


def fresh_prefill(url: str, tokens: int, rng: random.Random) -> float:
    """Seconds to the first token of a prompt of `tokens` fresh token ids (the least of
    two tries, each new to every cache): the prefill of a turn's new tokens alone."""
    times = []
    for _ in range(2):
        prompt = [rng.randrange(1000, 40000) for _ in range(max(1, tokens))]
        body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
        start = time.perf_counter()
        httpx.post(f"{url}/v1/completions", json=body, timeout=900).raise_for_status()
        times.append(time.perf_counter() - start)
    return round(min(times), 3)


def tool_results(turns: int, seed: int) -> list[str]:
    """The tool result each turn after the first appends."""
    rng = random.Random(seed)
    return [tool_result(rng) for _ in range(turns - 1)]


def next_messages(messages: list[dict], answer: str, result: str) -> list[dict]:
    """The agent's next request: its last answer and a tool result appended."""
    return messages + [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": result},
    ]


def play_turn(url: str, messages: list[dict], turn: int, rows: list[dict], rng) -> dict:
    """One turn against mlxspec (and a side request after turns 1 and 3)."""
    row = ask(url, messages)
    row.update(turn=turn, messages=json.loads(json.dumps(messages)))
    if rows:
        row["new_tokens"] = new = row["prompt_tokens"] - rows[-1]["prompt_tokens"]
        row["new_prefill_s"] = fresh_prefill(url, new, rng)
    if turn in (1, 3):
        row["side"] = ask(url, side_request(), 16)
    rows.append(row)
    return row


def replay_same(url: str, rows: list[dict]) -> list[dict]:
    """The very requests of `rows` (their side requests too), against another server."""
    out = []
    for row in rows:
        again = ask(url, row["messages"])
        if "side" in row:
            again["side"] = ask(url, side_request(), 16)
        out.append(again)
    return out


def smollm2_folder(folder: Path) -> Path:
    """SmolLM2-135M-Instruct as an mlx-lm folder (float weights, its tokenizer), from the
    packaged GGUF, so that both servers load the same weights."""
    from mlx_lm.utils import save_config, save_model

    from mlxspec.models.loading import load_model
    from mlxspec.models.packaged import ensure_packaged_model

    if (folder / "config.json").exists():
        return folder
    gguf = ensure_packaged_model("smollm2-135m")
    loaded = load_model(str(gguf), dequantize=True)
    folder.mkdir(parents=True, exist_ok=True)
    save_model(folder, loaded.model)
    config = {"model_type": "llama", **vars(loaded.model.args)}
    save_config(config, folder / "config.json")
    loaded.tokenizer._tokenizer.save_pretrained(folder)
    return folder


def random_folder(family: str, folder: Path, tokenizer_from: Path) -> Path:
    import importlib

    import mlx.core as mx
    from mlx_lm.utils import save_config, save_model

    if (folder / "config.json").exists():
        return folder
    config = dict(RANDOM[family], vocab_size=49152)
    module = importlib.import_module(f"mlx_lm.models.{family}")
    mx.random.seed(0)
    model = module.Model(module.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    folder.mkdir(parents=True, exist_ok=True)
    save_model(folder, model)
    save_config(config, folder / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, folder / name)
    return folder


def ideal_prefills(folder: Path, sessions: dict[str, list[dict]]) -> None:
    """Each later turn's `ideal_s`: the time to prefill only its new tokens onto a cache
    already holding what it shares with the turn before, and take its first token, in
    this process (mlx-lm's model and caches, nothing else running): what a perfect
    prompt cache would leave to do."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    model, tokenizer = load(str(folder))

    def ids(messages: list[dict]) -> list[int]:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def feed(cache, tokens: list[int]) -> None:
        """The cache only, as a prefill computes it: logits never evaluated, so the LM
        head never runs over every position (mlx computes what is evaluated)."""
        for start in range(0, len(tokens), 512):
            model(mx.array([tokens[start : start + 512]]), cache=cache)
            mx.eval([c.state for c in cache])

    for rows in sessions.values():
        for before, row in zip(rows, rows[1:]):
            old, new = ids(before["messages"]), ids(row["messages"])
            shared = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), len(old))
            cache = make_prompt_cache(model)
            feed(cache, new[:shared])
            start = time.perf_counter()
            feed(cache, new[shared:-1])  # then the last token, whose logits give the first
            mx.eval(mx.argmax(model(mx.array([new[-1:]]), cache=cache)[0, -1]))
            row["ideal_s"] = round(time.perf_counter() - start, 3)


def start_mlx_lm(folder: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    # With the BLAS mlxspec loads (Debian's OpenBLAS on Linux): the reference BLAS mlx's
    # CPU wheel bundles would make mlx-lm's every pass several times slower.
    launch = (
        "import runpy, sys; from mlxspec.blas import preload_openblas; preload_openblas(); "
        "sys.argv = ['mlx_lm', 'server', *sys.argv[1:]]; "
        "runpy.run_module('mlx_lm', run_name='__main__')"
    )
    command = [sys.executable, "-c", launch, "--model", str(folder)]
    server = subprocess.Popen([*command, "--port", str(port), "--log-level", "WARNING"])
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:  # any answer means it listens (its /v1/models fails without a hub cache)
            httpx.get(f"{url}/health", timeout=2)
            break
        except httpx.TransportError:
            time.sleep(1)
    return server, url


def stop(server: subprocess.Popen) -> None:
    server.send_signal(signal.SIGINT)
    try:
        server.wait(120)
    except subprocess.TimeoutExpired:
        server.kill()


def run_model(
    name: str, folder: Path, turns: int, seed: int, cache_dir: Path, against: bool = True
) -> dict:
    """Each agent's session: turns 1..T-1 on `serve`, then `serve` restarted (memory
    empty, disk not) for turn T; then the same requests on mlx-lm's server."""
    results, rng = tool_results(turns, seed), random.Random(seed + 1)
    args = f"-m {folder} --prompt-cache-dir {cache_dir / name} --max-tokens-limit {MAX_TOKENS}"
    args += f" {SERVE_ARGS}"
    sessions: dict[str, list[dict]] = {agent: [] for agent in AGENTS}
    serve, url = start_serve(args)
    try:
        for agent, rows in sessions.items():
            messages = first_request(agent)
            for turn in range(1, turns):
                row = play_turn(url, messages, turn, rows, rng)
                messages = next_messages(messages, row["text"], results[turn - 1])
            rows[-1]["next"] = messages
    finally:
        stop(serve)
    serve, url = start_serve(args)  # restarted: its memory is empty, its disk is not
    try:
        for rows in sessions.values():
            play_turn(url, rows[-1].pop("next"), turns, rows, rng)["after_restart"] = True
    finally:
        stop(serve)
    theirs = {
        agent: [{"ttft_s": None, "total_s": 0, "tokens_per_s": None, "text": None}] * len(rows)
        for agent, rows in sessions.items()
    }
    if against:
        server, url = start_mlx_lm(folder)
        try:
            theirs = {agent: replay_same(url, rows) for agent, rows in sessions.items()}
        finally:
            stop(server)
    ideal_prefills(folder, sessions)
    for agent, rows in sessions.items():
        for row, other in zip(rows, theirs[agent]):
            side = other.get("side", {}).get("total_s", 0)
            row["mlx_lm"] = {
                "ttft_s": other["ttft_s"],
                "total_s": other["total_s"] + side,
                "tokens_per_s": other["tokens_per_s"],
            }
            row["same_text"] = None if other["text"] is None else row["text"] == other["text"]
            del row["messages"]
    return sessions


def table(report: dict) -> str:
    lines = [
        "| model | agent | turn | prompt | reused | TTFT s | new tokens only s | ratio | "
        "new tokens alone s | mlx-lm TTFT s | tok/s | mlx-lm tok/s | same text |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model, sessions in report["models"].items():
        for agent, rows in sessions.items():
            for row in rows:
                new, ideal = row.get("new_prefill_s"), row.get("ideal_s")
                ratio = f"{row['ttft_s'] / ideal:.2f}" if ideal else ""
                turn = f"{row['turn']}{' (restarted)' if row.get('after_restart') else ''}"
                lines.append(
                    f"| {model} | {agent} | {turn} | {row['prompt_tokens']} | "
                    f"{row['cached_tokens']} | {row['ttft_s']} | {ideal or ''} | {ratio} | "
                    f"{new or ''} | "
                    f"{row['mlx_lm']['ttft_s']} | {row['tokens_per_s']} | "
                    f"{row['mlx_lm']['tokens_per_s']} | {row['same_text']} |"
                )
    lines.append("")
    for model, sessions in report["models"].items():
        rows = [row for session in sessions.values() for row in session]
        ours = sum(r["total_s"] + r.get("side", {}).get("total_s", 0) for r in rows)
        theirs = sum(r["mlx_lm"]["total_s"] for r in rows)
        if not theirs:
            lines.append(f"- {model}: every request of the sessions answered in {ours:.1f} s")
            continue
        lines.append(
            f"- {model}: every request of the sessions (side requests too) answered in "
            f"{ours:.1f} s here, {theirs:.1f} s on mlx-lm's server: {theirs / ours:.2f}x"
        )
    return "\n".join(lines)


def main() -> None:
    global PROPOSER, SERVE_ARGS, MAX_TOKENS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2,qwen3_5,gemma3_text")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--folders", type=Path, default=Path(tempfile.gettempdir()) / "replay")
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--proposer", help="mlxspec's proposer for every request (default: the model's)"
    )
    parser.add_argument("--no-mlx-lm", action="store_true", help="mlxspec alone (a proposer's run)")
    parser.add_argument("--serve-args", default="", help="more `mlxspec serve` options")
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="a turn's answer")
    args = parser.parse_args()
    PROPOSER, SERVE_ARGS, MAX_TOKENS = args.proposer, args.serve_args, args.max_tokens
    smollm2 = smollm2_folder(args.folders / "smollm2")
    report = {
        **{k: v for k, v in vars(args).items() if k != "folders" and k != "out"},
        "models": {},
    }
    cache_dir = Path(tempfile.mkdtemp(prefix="replay-cache-"))
    for name in args.models.split(","):
        folder = smollm2 if name == "smollm2" else random_folder(name, args.folders / name, smollm2)
        report["models"][name] = run_model(
            name, folder, args.turns, args.seed, cache_dir, against=not args.no_mlx_lm
        )
    shutil.rmtree(cache_dir, ignore_errors=True)
    print(table(report))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
