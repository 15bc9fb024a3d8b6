"""Forced tool calls in the formats whose arguments are not one JSON object, as Lark rules:
Qwen3.5's XML (mlx-lm's `qwen3_coder` parser) and Gemma 4's `call:NAME{...}` (its `gemma4`
parser). The markup is the template's, byte for byte:

    <tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>
    <|tool_call>call:NAME{key:<|"|>text<|"|>,n:3}<tool_call|>

Each value is written as its parser reads it back. Qwen3.5's parser types a parameter by
its schema's `type`: a string is the raw text (never "null", which it reads as None), a
number, boolean, object or array is JSON (here llguidance's `%json` of the parameter's
schema). Gemma 4's values are JSON with bare keys and strings between `<|"|>` markers, raw.
The parameters are the tool's properties in one order (Qwen: the schema's; Gemma: sorted,
as its template's `dictsort`), the required ones always there, no others. A raw string
holds none of the markup that would end it early (`</parameter>`, `</tool_call>`; `<|"|>`,
`<tool_call|>`). Leniently, as JSON tools are compiled: string `pattern`, `enum`, `const`,
`minLength` and `maxLength` are enforced; `format` and other keywords of raw strings are
not; a schema of several types, `anyOf` or `oneOf` is each branch in turn; a value with
no type at all is any text (Qwen) or any value (Gemma).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from mlxspec.settings import JSON_OPTIONS, GrammarError

QWEN3_CODER, GEMMA4 = "qwen3_coder", "gemma4"
PARAMETER_END = "\n</parameter>\n"
QUOTE = '<|"|>'  # Gemma 4's string delimiter
BARE_KEY = re.compile(r"\w+")  # a key Gemma 4's parser quotes itself
LENIENT = {**JSON_OPTIONS, "lenient": True}
JSON_TYPES = ("integer", "number", "boolean", "object", "array")
# A regex of any text; JSON schema's `pattern` searches, so one without anchors is wrapped.
ANY = "(?s:.*)"

Spelling = Callable[[str], str]


def literal(text: str) -> str:
    """`text` as a Lark string literal."""
    return json.dumps(text)


def native_call_rules(
    parser: str,
    functions: list[dict[str, Any]],
    markers: tuple[str, str],
    spell: Spelling,
    rule: str,
    parallel: bool,
) -> str:
    """Lark rules whose `rule` is one or more calls (one where not `parallel`) in
    `parser`'s format (QWEN3_CODER or GEMMA4), each to one of `functions` (with their
    parameters schemas checked); `markers`: the call's start and end."""
    rules = _Rules(spell, rule)
    start, end = (spell(marker) for marker in markers)
    alternatives = []
    for index, function in enumerate(functions):
        rules.definitions = _definitions(function["parameters"])
        write = _qwen_call if parser == QWEN3_CODER else _gemma_call
        try:
            body = write(rules, function["name"], function["parameters"])
        except GrammarError:
            raise
        except (AttributeError, TypeError, ValueError, KeyError) as err:
            # A client's schema that is no JSON schema ("properties": {"city": "string"},
            # "minLength": "x"): its mistake, told as one (400), not the server's.
            raise GrammarError(
                f"the parameters of tool {function['name']!r} are not a JSON schema this "
                f"server can read ({type(err).__name__}: {err})"
            ) from None
        alternatives.append(rules.add(f"{rule}_{index}", f"{start} {body} {end}"))
    call = rules.add(f"{rule}_call", " | ".join(alternatives))
    separator = '"\\n" ' if parser == QWEN3_CODER else ""  # as the templates write them
    more = f" ({separator}{call})*" if parallel else ""
    return "\n".join([f"{rule}: {call}{more}", *rules.lines])


class _Rules:
    """The rules written so far, each with a name of its own under `prefix`."""

    def __init__(self, spell: Spelling, prefix: str):
        self.spell, self.prefix = spell, prefix
        self.lines: list[str] = []
        self.definitions: dict[str, Any] = {}
        self._count = 0
        self._refs: dict[str, str] = {}
        self.written: set[str] = set()  # the shared rules written (Gemma's any value)

    def add(self, name: str | None, body: str, terminal: bool = False) -> str:
        if name is None:
            self._count += 1
            name = f"{self.prefix}_v{self._count}"
        name = name.upper() if terminal else name
        self.lines.append(f"{name}: {body}")
        return name

    def ref(self, schema: dict[str, Any], write: Callable[[_Rules, dict[str, Any]], str]) -> str:
        """A `$ref`'s target as a rule of its own (so a recursive schema is a recursive
        rule), written once per request."""
        target = schema["$ref"]
        key = f"{write.__name__}:{target}"
        if key not in self._refs:
            self._count += 1
            self._refs[key] = name = f"{self.prefix}_ref{self._count}"
            self.lines.append(f"{name}: {write(self, self._resolve(target))}")
        return self._refs[key]

    def _resolve(self, target: str) -> dict[str, Any]:
        for key in ("$defs", "definitions"):
            prefix = f"#/{key}/"
            if target.startswith(prefix) and target[len(prefix) :] in self.definitions.get(key, {}):
                return self.definitions[key][target[len(prefix) :]]
        raise GrammarError(f"cannot resolve the $ref {target!r}")

    def json(self, schema: dict[str, Any]) -> str:
        """`schema` as llguidance's JSON, with the definitions its `$ref`s point at."""
        return f"%json {json.dumps({'x-guidance': LENIENT, **self.definitions, **schema})}"

    def text(
        self, schema: dict[str, Any], excluded: tuple[str, ...], closing: str = "", *refused: str
    ) -> str:
        """A raw string valid against the string `schema`, holding none of `excluded`,
        matching none of the regexes `refused`, then `closing` (in the same terminal, so
        that the string ends where it starts)."""
        parts = [f"/{ANY}/", *(f"~/{regex}/" for regex in refused)]
        if "pattern" in schema:
            parts.append(f"/{_searching(schema['pattern'])}/")
        low, high = schema.get("minLength"), schema.get("maxLength")
        if low is not None or high is not None:
            parts.append(f"/(?s:.{{{int(low or 0)},{'' if high is None else int(high)}}})/")
        parts += [f"~/{ANY}{slashes(re.escape(text))}{ANY}/" for text in excluded]
        body = f"({' & '.join(parts)})"
        return self.add(None, f"{body} {literal(closing)}" if closing else body, terminal=True)


def _definitions(parameters: dict[str, Any]) -> dict[str, Any]:
    return {key: parameters[key] for key in ("$defs", "definitions") if key in parameters}


def _branches(schema: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The schemas a value may match one of (`anyOf`, `oneOf`, a list of types), or None."""
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            rest = {k: v for k, v in schema.items() if k != key}
            return [{**rest, **branch} for branch in schema[key]]
    if isinstance(schema.get("type"), list):
        return [{**schema, "type": kind} for kind in schema["type"]]
    return None


def _kind(schema: dict[str, Any]) -> str | None:
    """The schema's one type, said or implied; None: any."""
    kind = schema.get("type")
    if kind is not None:
        if kind not in (*JSON_TYPES, "string", "null"):
            raise GrammarError(f"unknown type {kind!r} in a tool's parameters")
        return kind
    if "properties" in schema:
        return "object"
    if "items" in schema:
        return "array"
    return None


def _qwen_call(rules: _Rules, name: str, parameters: dict[str, Any]) -> str:
    """`<function=NAME>` and its parameters, each as the template writes it."""
    required = set(parameters.get("required") or ())
    pieces = [literal(f"\n<function={name}>\n")]
    for key, schema in (parameters.get("properties") or {}).items():
        opening = literal(f"<parameter={key}>\n")
        parameter = rules.add(None, f"{opening} {_qwen_value(rules, schema)}")
        pieces.append(parameter if key in required else f"{parameter}?")
    pieces.append(literal("</function>\n"))
    return " ".join(pieces)


def _qwen_value(rules: _Rules, schema: dict[str, Any]) -> str:
    """A parameter's value and the markup that closes it."""
    if "$ref" in schema:
        return rules.ref(schema, _qwen_value)
    if (branches := _branches(schema)) is not None:
        return "(" + " | ".join(_qwen_value(rules, branch) for branch in branches) + ")"
    kind, close = _kind(schema), literal(PARAMETER_END)
    choices = (
        schema["enum"] if "enum" in schema else [schema["const"]] if "const" in schema else None
    )
    if choices is not None and kind in (None, "string"):
        texts = [c if isinstance(c, str) else json.dumps(c) for c in choices]
        return "(" + " | ".join(literal(text + PARAMETER_END) for text in texts) + ")"
    if kind in JSON_TYPES:
        return f"{rules.json(schema)} {close}"
    if kind == "null":
        return literal("null" + PARAMETER_END)
    excluded = ("</parameter>", "</tool_call>")
    if kind == "string":  # the parser reads "null", in any case, as None
        return rules.text(schema, excluded, PARAMETER_END, "(?i:null)")
    return rules.text({}, excluded, PARAMETER_END)


def _gemma_call(rules: _Rules, name: str, parameters: dict[str, Any]) -> str:
    return f"{literal(f'call:{name}')} {_gemma_object(rules, parameters)}"


def _gemma_value(rules: _Rules, schema: dict[str, Any]) -> str:
    if "$ref" in schema:
        return rules.ref(schema, _gemma_value)
    if (branches := _branches(schema)) is not None:
        return "(" + " | ".join(_gemma_value(rules, branch) for branch in branches) + ")"
    choices = (
        schema["enum"] if "enum" in schema else [schema["const"]] if "const" in schema else None
    )
    if choices is not None:
        return "(" + " | ".join(_gemma_literal(rules, choice) for choice in choices) + ")"
    kind = _kind(schema)
    if kind == "string":
        return _gemma_string(rules, schema)
    if kind == "object":
        return _gemma_object(rules, schema)
    if kind == "array":
        item = _gemma_value(rules, schema.get("items") or {})
        return f'"[" ({item} ("," {item})*)? "]"'
    if kind is None:
        return _gemma_any(rules)
    return rules.json(schema)  # numbers, booleans and null are JSON's


def _gemma_string(rules: _Rules, schema: dict[str, Any]) -> str:
    quote = rules.spell(QUOTE)
    excluded = (QUOTE, "<tool_call|>")
    if quote.startswith("<["):  # a special token: text never is one
        return f"{quote} {rules.text(schema, excluded)} {quote}"
    return f"{quote} {rules.text(schema, excluded, QUOTE)}"


def _gemma_key(rules: _Rules, key: str) -> str:
    if BARE_KEY.fullmatch(key):
        return literal(f"{key}:")
    return f"{_gemma_literal(rules, key)} {literal(':')}"


def _gemma_literal(rules: _Rules, value: Any) -> str:
    """A constant as the template's `format_argument` writes it (keys bare)."""
    if isinstance(value, str):
        quote = rules.spell(QUOTE)
        return f"{quote} {literal(value)} {quote}"
    if isinstance(value, dict):
        pairs = sorted(value.items(), key=lambda pair: pair[0].lower())
        inner = ' "," '.join(
            f"{_gemma_key(rules, key)} {_gemma_literal(rules, item)}" for key, item in pairs
        )
        return f'"{{" {inner} "}}"' if inner else '"{}"'
    if isinstance(value, list):
        inner = ' "," '.join(_gemma_literal(rules, item) for item in value)
        return f'"[" {inner} "]"' if inner else '"[]"'
    return literal(json.dumps(value))


def _gemma_object(rules: _Rules, schema: dict[str, Any]) -> str:
    """`{key:value,...}`: the properties in the template's order (dictsort: sorted, case
    aside), each required one present, commas only between those present."""
    properties = schema.get("properties") or {}
    if not properties:
        return (
            _gemma_any_object(rules) if schema.get("additionalProperties") is not False else '"{}"'
        )
    required = set(schema.get("required") or ())
    keys = sorted(properties, key=str.lower)
    items = [
        rules.add(None, f"{_gemma_key(rules, key)} {_gemma_value(rules, properties[key])}")
        for key in keys
    ]
    tails: list[str] = [""] * (len(keys) + 1)  # tails[i]: ",item" for those from i on
    for i in reversed(range(1, len(keys))):
        piece = f'"," {items[i]}' if keys[i] in required else f'("," {items[i]})?'
        tails[i] = rules.add(None, f"{piece} {tails[i + 1]}".strip())
    heads = []  # the first item present, then the rest
    for i, key in enumerate(keys):
        heads.append(f"{items[i]} {tails[i + 1]}".strip())
        if key in required:
            break
    inner = f"({' | '.join(heads)})"
    if not required:
        inner += "?"
    return f'"{{" {inner} "}}"'


def _gemma_any(rules: _Rules) -> str:
    """Any value in Gemma 4's spelling: a rule of its own, written once."""
    name = f"{rules.prefix}_any"
    if f"{name}_object" not in rules.written:
        rules.written.add(f"{name}_object")
        key = rules.add(None, f"/{BARE_KEY.pattern}/ {literal(':')}", terminal=True)
        scalar = rules.json({"type": ["number", "boolean", "null"]})
        array = f'"[" ({name} ("," {name})*)? "]"'
        rules.add(name, f"{_gemma_string(rules, {})} | {scalar} | {name}_object | {array}")
        rules.add(f"{name}_object", f'"{{" ({key} {name} ("," {key} {name})*)? "}}"')
    return name


def _gemma_any_object(rules: _Rules) -> str:
    return f"{_gemma_any(rules)}_object"


def _searching(pattern: str) -> str:
    """A JSON schema `pattern` (a search) as a regex of the whole text, its `/` escaped."""
    anchored_start = pattern.startswith("^")
    anchored_end = pattern.endswith("$") and not pattern.endswith("\\$")
    core = pattern[1 if anchored_start else 0 : -1 if anchored_end else None]
    body = f"{'' if anchored_start else ANY}(?:{core}){'' if anchored_end else ANY}"
    return slashes(body)


def slashes(pattern: str) -> str:
    """A regex with its unescaped `/` escaped, to sit between Lark's slashes."""
    out, escaped = [], False
    for char in pattern:
        out.append("\\/" if char == "/" and not escaped else char)
        escaped = char == "\\" and not escaped
    return "".join(out)
