"""What a JSON schema asks that the grammar would not enforce, found before it is used.

llguidance compiles a client's schema leniently (a tool's parameters, a non-strict
`response_format`): a keyword it cannot enforce (`dependentRequired`, `not`, `if`,
`uniqueItems`...) is then ignored, with a warning, and an answer may break the schema.
The server refuses such a schema with a 4xx naming the keyword (`unenforced`) rather than
answer what the schema rejects. Two warnings are harmless and pass: an unknown `format`
(an annotation, not an assertion, in draft 2020-12 and for the `jsonschema` library), and
`oneOf` where its branches cannot both match (`exclusive_one_of` rewrites those as the
`anyOf` they are equal to, before compiling; any other `oneOf` is refused).
"""

from __future__ import annotations

import json
import re
from itertools import combinations
from typing import Any

UNIMPLEMENTED = re.compile(r"^Unimplemented keys: \[(.*)\]")
ANNOTATION = re.compile(r"^Unknown format: ")  # format asserts nothing unless asked
ONE_OF = "oneOf not fully supported"
TYPES = ("null", "boolean", "object", "array", "string", "number", "integer")


def unenforced(warnings: list[str]) -> str | None:
    """The problem (one line, naming the keyword) in llguidance's warnings from a lenient
    compile, or None where each is harmless."""
    for warning in warnings:
        first = warning.strip().splitlines()[0] if warning.strip() else ""
        if not first or ANNOTATION.match(first):
            continue
        if found := UNIMPLEMENTED.match(first):
            return f"cannot enforce the keyword(s) {found.group(1)}"
        if first.startswith(ONE_OF):
            return 'cannot enforce the keyword "oneOf" where its branches may overlap'
        return f"cannot enforce the schema: {first}"
    return None


def exclusive_one_of(schema: Any) -> Any:
    """`schema` with each `oneOf` whose branches exclude each other written as `anyOf`
    (what it then means); any other `oneOf` stays, for the compiler to warn of. A schema
    too deep to walk is left as it is (the compiler says what is wrong with it)."""
    try:
        return _rewritten(schema, schema)
    except RecursionError:
        return schema


def _rewritten(schema: Any, root: Any) -> Any:
    if isinstance(schema, list):
        return [_rewritten(item, root) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _rewritten(value, root) for key, value in schema.items()}
    branches = out.get("oneOf")
    if isinstance(branches, list) and "anyOf" not in out and _exclusive(branches, root):
        out["anyOf"] = out.pop("oneOf")
    return out


def _exclusive(branches: list[Any], root: Any) -> bool:
    """Whether no two branches can match one value; False where a keyword's value is not
    what the draft says it is (the compiler refuses that schema anyway)."""
    resolved = [_resolve(branch, root) for branch in branches]
    try:
        return all(_disjoint(a, b) for a, b in combinations(resolved, 2))
    except (TypeError, ValueError, AttributeError):
        return False


def _resolve(branch: Any, root: Any) -> Any:
    """A branch with its local `$ref` (`#/...`) followed, once; else as it is."""
    ref = branch.get("$ref") if isinstance(branch, dict) else None
    if not isinstance(ref, str) or not ref.startswith("#/") or len(branch) > 1:
        return branch
    target = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(target, dict) or part not in target:
            return branch
        target = target[part]
    return target


def _disjoint(a: Any, b: Any) -> bool:
    """Whether no JSON value can match both schemas, as far as plain keywords show."""
    if not isinstance(a, dict) or not isinstance(b, dict):
        return a is False or b is False
    types_a, types_b = _types(a), _types(b)
    if types_a is not None and types_b is not None and not types_a & types_b:
        return True
    for one, other in ((a, b), (b, a)):
        values = _values(one)
        if values is not None and all(_excludes(other, value) for value in values):
            return True
    if types_a == types_b == {"object"}:  # a discriminator: a property both require
        for key in set(a.get("properties", {})) & set(b.get("properties", {})):
            if key in a.get("required", ()) and key in b.get("required", ()):
                if _disjoint(a["properties"][key], b["properties"][key]):
                    return True
    return False


def _types(schema: dict[str, Any]) -> set[str] | None:
    """The JSON types a schema allows (None: any), an integer being a number too."""
    values = _values(schema)
    if values is not None:
        found = {_type_of(value) for value in values}
    elif isinstance(schema.get("type"), str):
        found = {schema["type"]}
    elif isinstance(schema.get("type"), list):
        found = set(schema["type"])
    else:
        return None
    if "number" in found:
        found.add("integer")
    if "integer" in found:
        found.add("number")
    return found


def _values(schema: dict[str, Any]) -> list[Any] | None:
    if "const" in schema:
        return [schema["const"]]
    enum = schema.get("enum")
    return enum if isinstance(enum, list) else None


def _type_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    kinds = {float: "number", str: "string", list: "array", dict: "object"}
    return kinds.get(type(value), "object")


def _excludes(schema: dict[str, Any], value: Any) -> bool:
    """Whether `schema` rejects `value`, by its plain keywords (False where unsure)."""
    types = _types(schema)
    if types is not None and _type_of(value) not in types:
        return True
    values = _values(schema)
    if values is not None:
        text = json.dumps(value, sort_keys=True)
        return all(json.dumps(other, sort_keys=True) != text for other in values)
    if isinstance(value, str):
        pattern = schema.get("pattern")
        if isinstance(pattern, str):
            try:
                return re.search(pattern, value) is None
            except re.error:
                return False
        return len(value) < schema.get("minLength", 0) or len(value) > schema.get(
            "maxLength", len(value)
        )
    return False
