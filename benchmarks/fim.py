"""Inline completion on a real fill-in-the-middle model: holes cut from Python files nobody
here wrote (this machine's standard library), sent to `/infill` as llama.vim sends them.

    python benchmarks/fim.py --model ~/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf --holes 6
    python benchmarks/fim.py --model FILE --proposers none,prompt-lookup,suffix --out fim.json

Classes of hole, each cut at line boundaries (the cursor on the emptied line): `line` (one
line of code), `block` (3 to 6 lines), `suffix` (a line whose text comes again within the
64 lines after the cursor, which llama.vim sends as the suffix), `extra` (a block the
editor also holds in another chunk: llama.vim's ring buffer of recently yanked and visited
text, sent as `input_extra`). The request is llama.vim's: 256 lines of prefix, 64 of
suffix, `n_predict` 128; `t_max_predict_ms` is 0 here (llama.vim's default, 1000 ms,
would cut completions by this CPU's speed rather than by the model's answer).

Every hole's prompt is first taken into the cache (`n_predict` 0, llama.vim's warm-up) and
timed: the cold prefill. Then each proposer completes it from the same cached prompt, so
their times compare decoding alone, hole by hole in one run. Then the next keystroke: the
same hole with the answer's first character typed; its time to first token is set against
a fresh prompt of as many tokens as it prefilled (`/completion`, another file's text):
what prefilling only the changed tokens costs. Exact match (the completion starts with the
removed code) is a sanity figure of the model, not a goal. Greedy: every proposer's text
must equal plain decoding's (`none`), and the script says where one does not.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import httpx

N_PREFIX, N_SUFFIX, N_PREDICT = 256, 64, 128  # llama.vim's defaults
FRESH = itertools.count()  # where the next fresh prompt starts in the filler text
CLASSES = ("line", "block", "suffix", "extra")


def source_files() -> list[Path]:
    """The standard library's own modules of a workable size, in a fixed order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in stdlib.glob("*.py") if 8_000 < p.stat().st_size < 120_000)


def _code(line: str) -> bool:
    stripped = line.strip()
    return len(stripped) >= 12 and not stripped.startswith(("#", '"', "'", "@"))


def _indent(line: str) -> str:
    return line[: len(line) - len(line.lstrip())]


def hole(lines: list[str], start: int, size: int, name: str, kind: str, extra=()) -> dict:
    """The request parts llama.vim sends with the cursor on line `start`, emptied, and the
    `size - 1` lines after it removed. llama.vim sends a line of blanks as no line at all
    (`prompt` "", `n_indent` 0: `s:fim_ctx_local`), so the answer is the removed lines
    with their indentation."""
    removed = lines[start : start + size]
    after = lines[start + size : start + size + N_SUFFIX]
    return {
        "class": kind,
        "file": name,
        "line": start + 1,
        "input_prefix": "".join(line + "\n" for line in lines[max(0, start - N_PREFIX) : start]),
        "prompt": "",
        "input_suffix": "\n" + "".join(line + "\n" for line in after),
        "input_extra": list(extra),
        "n_indent": 0,
        "answer": "\n".join(removed),
    }


def holes(per_class: int, seed: int) -> list[dict]:
    """`per_class` holes of each class, from files and lines picked by `seed`."""
    rng = random.Random(seed)
    files = source_files()
    found: dict[str, list[dict]] = {kind: [] for kind in CLASSES}
    while any(len(found[kind]) < per_class for kind in CLASSES):
        path = rng.choice(files)
        lines = path.read_text(errors="replace").splitlines()
        name = path.name
        start = rng.randrange(40, max(41, len(lines) - 80))
        if not _code(lines[start]):
            continue
        if len(found["line"]) < per_class:
            found["line"].append(hole(lines, start, 1, name, "line"))
        size = rng.randint(3, 6)
        block = lines[start : start + size]
        same_block = all(_indent(line) >= _indent(block[0]) and line.strip() for line in block)
        if same_block and len(found["block"]) < per_class:
            found["block"].append(hole(lines, start, size, name, "block"))
        if same_block and len(found["extra"]) < per_class:
            around = lines[max(0, start - 8) : start + size + 8]
            chunk = {"filename": name, "text": "\n".join(around) + "\n"}
            found["extra"].append(hole(lines, start, size, name, "extra", [chunk]))
        repeats = [
            i
            for i in range(40, len(lines) - N_SUFFIX)
            if _code(lines[i])
            and lines[i].strip() in (line.strip() for line in lines[i + 1 : i + N_SUFFIX])
        ]
        if repeats and len(found["suffix"]) < per_class:
            found["suffix"].append(hole(lines, rng.choice(repeats), 1, name, "suffix"))
    return [h for kind in CLASSES for h in found[kind]]


def infill_body(h: dict, proposer: str | None, n_predict: int = N_PREDICT) -> dict:
    body = {key: h[key] for key in ("input_prefix", "input_suffix", "input_extra", "prompt")}
    body |= {"id_slot": 0, "n_predict": n_predict, "n_indent": h["n_indent"], "stop": []}
    body |= {"temperature": 0.0, "stream": False, "cache_prompt": True, "t_max_predict_ms": 0}
    body |= {"samplers": ["top_k", "top_p", "infill"]}
    if proposer is not None:
        body["mlxspec"] = {"proposer": proposer}
    return body


def post(client: httpx.Client, path: str, body: dict) -> tuple[dict, float]:
    started = time.perf_counter()
    response = client.post(path, json=body)
    response.raise_for_status()
    return response.json(), time.perf_counter() - started


def exact(content: str, answer: str) -> bool:
    """The completion starts with the removed code (trailing blanks of lines aside)."""

    def norm(text: str) -> str:
        return "\n".join(line.rstrip() for line in text.split("\n"))

    return norm(content).startswith(norm(answer).rstrip())


def run_hole(client: httpx.Client, h: dict, proposers: list[str], filler: str) -> dict:
    warm, cold_seconds = post(client, "/infill", infill_body(h, None, n_predict=0))
    row: dict = {key: h[key] for key in ("class", "file", "line")}
    row["prompt_tokens"] = warm["tokens_evaluated"]
    row["cold_prefill_s"] = warm["timings"]["prompt_ms"] / 1000
    for proposer in proposers:
        result, seconds = post(client, "/infill", infill_body(h, proposer))
        record = result["x_mlxspec"]
        row[proposer] = {
            "seconds": seconds,
            "ttft": record["time_to_first_token"],
            "tokens": record["completion_tokens"],
            "drafted": record["drafted"],
            "accepted": record["accepted"],
            "exact": exact(result["content"], h["answer"]),
            "text": result["content"],
        }
    typed = dict(h, prompt=h["prompt"] + h["answer"][:1])
    next_key, _ = post(client, "/infill", infill_body(typed, proposers[-1], n_predict=1))
    changed = next_key["timings"]["prompt_n"]
    # As many fresh tokens (another file's text, never sent before) prefilled alone: about
    # 3.5 characters a token, corrected once by the count the first try gave.
    start = next(FRESH) * 4_001 % (len(filler) // 2)  # never the same text twice
    chars = int(changed * 3.5) + 1
    fresh, _ = post(
        client, "/completion", {"prompt": filler[start : start + chars], "n_predict": 1}
    )
    if abs(fresh["tokens_evaluated"] - changed) > max(2, changed // 10):
        chars = max(1, chars * changed // max(1, fresh["tokens_evaluated"]))
        start += len(filler) // 4
        body = {"prompt": filler[start : start + chars], "n_predict": 1}
        fresh, _ = post(client, "/completion", body)
    row["keystroke"] = {
        "changed_tokens": changed,
        "ttft": next_key["x_mlxspec"]["time_to_first_token"],
        "fresh_tokens": fresh["tokens_evaluated"],
        "fresh_ttft": fresh["x_mlxspec"]["time_to_first_token"],
    }
    return row


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def report(rows: list[dict], proposers: list[str]) -> str:
    plain = proposers[0]
    out = [
        "| class | holes | method | exact | total p50 s | total p90 s | TTFT p50 s | tok/s | "
        f"drafts kept | vs {plain} |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for kind in CLASSES:
        of_class = [row for row in rows if row["class"] == kind]
        if not of_class:
            continue
        base = sum(row[plain]["seconds"] for row in of_class)
        for proposer in proposers:
            runs = [row[proposer] for row in of_class]
            seconds = [run["seconds"] for run in runs]
            tokens = sum(run["tokens"] for run in runs)
            drafted, accepted = sum(r["drafted"] for r in runs), sum(r["accepted"] for r in runs)
            kept = f"{accepted}/{drafted}" if drafted else "-"
            out.append(
                f"| {kind} | {len(runs)} | {proposer} | {sum(r['exact'] for r in runs)} | "
                f"{percentile(seconds, 0.5):.2f} | {percentile(seconds, 0.9):.2f} | "
                f"{percentile([r['ttft'] for r in runs], 0.5):.2f} | "
                f"{tokens / sum(seconds):.1f} | {kept} | {base / sum(seconds):.2f}x |"
            )
    if "llama.cpp" in rows[0]:
        out += ["", "| class | llama.cpp plain s | llama.cpp n-gram s | its ratio | ours |"]
        out.append("|---|---|---|---|---|")
        for kind in CLASSES:
            of_class = [row for row in rows if row["class"] == kind]
            if not of_class:
                continue
            theirs = [sum(row["llama.cpp"][m] for row in of_class) for m in ("plain", "ngram")]
            ours = sum(row[plain]["seconds"] for row in of_class) / sum(
                row[proposers[-1]]["seconds"] for row in of_class
            )
            out.append(
                f"| {kind} | {theirs[0]:.2f} | {theirs[1]:.2f} | {theirs[0] / theirs[1]:.2f}x | "
                f"{ours:.2f}x |"
            )
    keys = [row["keystroke"] for row in rows]
    ratios = [k["ttft"] / k["fresh_ttft"] for k in keys]
    cold = statistics.median(row["cold_prefill_s"] for row in rows)
    out.append("")
    out.append(
        f"Next keystroke: TTFT p50 {statistics.median(k['ttft'] for k in keys):.3f} s after "
        f"prefilling {statistics.median(k['changed_tokens'] for k in keys):.0f} changed tokens "
        f"(median); a fresh prompt of as many tokens: "
        f"{statistics.median(k['fresh_ttft'] for k in keys):.3f} s; ratio p50 "
        f"{statistics.median(ratios):.2f}, p90 {percentile(ratios, 0.9):.2f}. The hole's cold "
        f"prefill (median {statistics.median(r['prompt_tokens'] for r in rows):.0f} tokens): "
        f"{cold:.2f} s."
    )
    differ = [
        f"{row['file']}:{row['line']} ({p})"
        for row in rows
        for p in proposers[1:]
        if row[p]["text"] != row[plain]["text"]
    ]
    out.append(
        "Every completion equals plain decoding's."
        if not differ
        else f"Completions that differ from {plain}: {', '.join(differ)}"
    )
    return "\n".join(out)


# llama.cpp's own speculation without a draft model: its n-gram lookup over the context
# (`--spec-type ngram-simple`, its prompt lookup), at most 16 drafts a round.
LLAMA_CPP_SPEC = ["--spec-type", "ngram-simple", "--spec-draft-n-max", "16"]


def llama_cpp_seconds(binary: str, model: str, hs: list[dict], spec: list[str]) -> list[float]:
    """llama.cpp's `llama-server` on the same holes, the same way (warm-up first, then the
    completion), 2 threads; seconds per hole. A benchmark's yardstick, never a dependency."""
    import socket
    import subprocess

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [binary, "-m", model, "--port", str(port), "-t", "2", "-c", "8192", *spec]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=900) as client:
            deadline = time.monotonic() + 300
            while True:
                try:
                    if client.get("/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("llama-server did not start")
                time.sleep(0.5)
            seconds = []
            greedy = {"samplers": ["top_k"], "top_k": 1}  # llama.vim's chain samples
            for h in hs:
                post(client, "/infill", infill_body(h, None, n_predict=0))
                seconds.append(post(client, "/infill", infill_body(h, None) | greedy)[1])
            return seconds
    finally:
        server.terminate()
        server.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a FIM model: a .gguf file or folder")
    parser.add_argument("--holes", type=int, default=6, help="holes per class")
    parser.add_argument("--proposers", default="none,prompt-lookup")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--weights", default=None, help="auto, quantized or dequantized")
    parser.add_argument("--fim-order", default=None, help="psm or spm (default: the model's)")
    parser.add_argument("--out", type=Path, default=None, help="write every row as JSON")
    parser.add_argument(
        "--llama-server", default=None, help="llama.cpp's llama-server: its plain and n-gram"
    )
    args = parser.parse_args()
    # a fresh history and prompt-cache folder: nothing learned before this run is read
    os.environ["MLXSPEC_DATA"] = tempfile.mkdtemp(prefix="mlxspec-fim-")
    from mlxspec.registry.models_toml import load_registry
    from mlxspec.server import RegistryProvider, create_app
    from mlxspec.server.background import serving_in_thread

    registry = load_registry().including(args.model)
    registry = registry.with_defaults(weights=args.weights, fim_order=args.fim_order)
    provider = RegistryProvider(registry, args.model, notify=lambda m: print(m, file=sys.stderr))
    proposers = args.proposers.split(",")
    filler = re.sub(r"\s+", " ", (source_files()[0]).read_text())
    rows = []
    with serving_in_thread(create_app(provider, preload=args.model), 600) as url:
        with httpx.Client(base_url=url, timeout=900) as client:
            for index, h in enumerate(holes(args.holes, args.seed)):
                rows.append(run_hole(client, h, proposers, filler))
                print(f"{index + 1}: {h['class']} {h['file']}:{h['line']}", file=sys.stderr)
    if args.llama_server:
        hs = holes(args.holes, args.seed)
        plain = llama_cpp_seconds(args.llama_server, args.model, hs, [])
        spec = llama_cpp_seconds(args.llama_server, args.model, hs, LLAMA_CPP_SPEC)
        for row, plain_s, spec_s in zip(rows, plain, spec):
            row["llama.cpp"] = {"plain": plain_s, "ngram": spec_s}
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    print(report(rows, proposers))


if __name__ == "__main__":
    main()
