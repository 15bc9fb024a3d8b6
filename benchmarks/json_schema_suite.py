"""The JSON-Schema-Test-Suite against a real `mlxspec serve`: each schema asked for as OpenAI's
`response_format`, the Responses API's `text.format`, Anthropic's `output_config.format` and a
forced tool's parameters (tests/schema_suite.py builds and judges each request). The table:
schemas enforced (a finished answer the schema accepts), refused (a 4xx, by keyword), cut at
max_tokens (not judged), and the two that must stay 0: answers the schema rejects, and 5xx.

    python benchmarks/json_schema_suite.py                  # the first schema of each file
    python benchmarks/json_schema_suite.py --suite DIR      # every schema: the sdist's json/tests

DIR: `json/tests` of the `jsonschema` sdist (pip download --no-deps --no-binary :all:
jsonschema). Results: docs/structured-output.md.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
from serving import start_serve

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import schema_suite  # noqa: E402  (the test's helper: one way to ask, one way to judge)

DRAFTS = ("draft2020-12", "draft7")
KEYWORD = re.compile(r'keyword\(?s?\)? "([^"]+)"|"oneOf"|(Resource) |(valid dictionary)')


def every_schema(folder: Path) -> dict[str, object]:
    """Every schema of the suite's files for DRAFTS (not optional/), by draft/file/index."""
    found = {}
    for draft in DRAFTS:
        for path in sorted((folder / draft).glob("*.json")):
            for index, case in enumerate(json.loads(path.read_text())):
                found[f"{draft}/{path.stem}/{index}"] = case["schema"]
    return found


def refusal(message: str) -> str:
    """What a 4xx names: the keyword, a remote $ref, or a schema that is no object."""
    found = KEYWORD.search(message)
    if found is None:
        return "other"
    if found.group(0) == '"oneOf"':
        return "oneOf"
    return next(group for group in found.groups() if group).replace("Resource", "remote $ref")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", type=Path, help="the sdist's json/tests (default: vendored)")
    parser.add_argument("--url", help="a running serve (default: start one)")
    parser.add_argument("--serve-args", default="", help="extra `mlxspec serve` options")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--forms", default=",".join(schema_suite.FORMS), help="which ways")
    parser.add_argument("--out", type=Path, help="the outcomes as JSON")
    args = parser.parse_args()
    if args.suite is not None:
        schema_suite.SCHEMAS.clear()
        schema_suite.SCHEMAS.update(every_schema(args.suite))
    serve, url = (None, args.url) if args.url else start_serve(args.serve_args)
    started = time.monotonic()
    try:
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        outcomes = {}
        with httpx.Client(base_url=url, timeout=600) as client:
            for form in args.forms.split(","):
                for name in schema_suite.SCHEMAS:
                    # a name with an index is judged with its draft, as the first schema is
                    outcome = schema_suite.run(client, name, form, model, args.max_tokens)
                    outcomes[f"{form} {name}"] = outcome
                    if outcome.kind in (schema_suite.INVALID, schema_suite.SERVER_ERROR):
                        print(form, name, outcome, flush=True)
    finally:
        if serve is not None:
            serve.terminate()
            serve.wait()
    report(outcomes, args.forms.split(","), model, time.monotonic() - started)
    if args.out:
        rows = {key: [o.kind, o.detail[:200]] for key, o in outcomes.items()}
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


def report(outcomes: dict, forms: list[str], model: str, seconds: float) -> None:
    """The table: one row per form, then the refusals by what they name."""
    kinds = (
        schema_suite.ENFORCED,
        schema_suite.REFUSED,
        schema_suite.CUT,
        schema_suite.INVALID,
        schema_suite.SERVER_ERROR,
    )
    print(f"\n{model}, {len(schema_suite.SCHEMAS)} schemas, {seconds:.0f} s\n")
    print("| asked as | " + " | ".join(kinds) + " |")
    print("|---" * (len(kinds) + 1) + "|")
    for form in forms:
        counts = Counter(o.kind for key, o in outcomes.items() if key.startswith(form + " "))
        print(f"| {form} | " + " | ".join(str(counts[kind]) for kind in kinds) + " |")
    refused = Counter(
        refusal(o.detail) for o in outcomes.values() if o.kind == schema_suite.REFUSED
    )
    print(
        "\nrefused, by what the 4xx names: "
        + ", ".join(f"{k} {n}" for k, n in refused.most_common())
    )


if __name__ == "__main__":
    main()
