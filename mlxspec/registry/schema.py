"""What each key of a models.toml may hold: its type, the rule an error message states, its
default, and whether it names a model (resolved against the file's folder). models_toml.py
reads a file against these tables."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mlxspec.decoding.weights_choice import CHOICES
from mlxspec.markup.fim import FAMILIES, ORDERS

FALLBACK = "prompt-lookup"  # needs no weights, so every entry gets one

REQUIRED = object()


@dataclass(frozen=True)
class Option:
    type: type  # int, float, str, list (of strings) or dict (a table)
    rule: str  # what a valid value is, as a noun phrase for error messages
    default: Any = REQUIRED  # None: optional without a value
    ok: Callable[[Any], bool] = lambda value: True
    reference: bool = False  # a model reference: local paths resolve against the file


def integer(low: int, default: Any = REQUIRED, note: str = "") -> Option:
    return Option(int, f"an integer >= {low}{note}", default, lambda v: v >= low)


REFERENCE = Option(
    str, "a packaged name, a hub repo id (owner/name) or a local path", reference=True
)
ENTRY_OPTIONS = {
    "target": REFERENCE,
    "description": Option(str, "a string", ""),
    "default_proposer": Option(str, "a proposer name or 'none'", FALLBACK),
}
ENTRY_TABLES = ("defaults", "proposers")
PENALTY_RULE = "a number from -2 to 2 (0 = off)"  # OpenAI's range
# Defaults are None here so that Defaults' own field defaults apply to what is left out.
DEFAULTS_OPTIONS = {
    "temperature": Option(float, "a number >= 0", None, lambda v: v >= 0),
    "top_p": Option(float, "a number > 0 and <= 1", None, lambda v: 0 < v <= 1),
    "top_k": integer(0, None, " (0 = off)"),
    "presence_penalty": Option(float, PENALTY_RULE, None, lambda v: -2 <= v <= 2),
    "frequency_penalty": Option(float, PENALTY_RULE, None, lambda v: -2 <= v <= 2),
    "max_tokens": integer(1, None),
    "context": integer(1, None),
    "tree": Option(bool, "true or false", None),
    "tree_nodes": integer(1, None),
    "history": Option(bool, "true or false", None),
    "weights": Option(str, "'auto', 'quantized' or 'dequantized'", None, lambda v: v in CHOICES),
    "chat_template_kwargs": Option(dict, "a table, e.g. { enable_thinking = false }", None),
    "fim": Option(
        str,
        f"'auto', 'none' or a fill-in-the-middle layout ({', '.join(FAMILIES)})",
        None,
        lambda v: v in ("auto", "none", *FAMILIES),
    ),
    "fim_order": Option(str, "'auto', 'psm' or 'spm'", None, lambda v: v in ("auto", *ORDERS)),
    "kv_bits": Option(int, "4 or 8 (KV cache quantization)", None, lambda v: v in (4, 8)),
    "kv_group_size": Option(int, "32, 64 or 128", None, lambda v: v in (32, 64, 128)),
    "quantized_kv_start": integer(0, None),
}
KIND_OPTIONS: dict[str, dict[str, Option]] = {
    kind: {**options, "k_max": integer(1, 32)}
    for kind, options in {
        "prompt-lookup": {"ngram_max": integer(1, 4), "ngram_min": integer(1, 2)},
        "suffix": {
            "spec_factor": Option(float, "a number > 0", 2.0, lambda v: v > 0),
            "min_match": integer(1, 2),
            "seed": Option(bool, "true or false", False),
        },
        "draft-model": {
            "draft": REFERENCE,
            "draft_layers": integer(1, None),
            # The draft's own form (decoding/draft_form.py): auto measures both beside the
            # target where it is stored quantized and keeps the cheaper.
            "weights": Option(
                str, "'auto', 'quantized' or 'dequantized'", "auto", lambda v: v in CHOICES
            ),
        },
        "self-spec": {
            "layers": integer(1),
            "exit": Option(str, "a path or hub repo id of an exit head", None, reference=True),
        },
        "head": {"path": Option(str, "a path or hub repo id of a drafter head", reference=True)},
        # The model's own MTP layer: `path` defaults to where `mlxspec pull NAME --mtp`
        # puts it; `source` is the original checkpoint it is pulled from.
        "mtp": {
            "path": Option(str, "a path or hub repo id of MTP weights", None, reference=True),
            "source": Option(str, "the original checkpoint (hub repo id)", None, reference=True),
        },
        "chain": {"members": Option(list, "a non-empty list of proposer names", ok=bool)},
        "lookahead": {"window": integer(1, 5), "ngram": integer(2, 4), "guesses": integer(0, 3)},
        "medusa": {"path": Option(str, "a path or hub repo id of Medusa heads", reference=True)},
        "block": {
            "path": Option(
                str, "a path or hub repo id of a DFlash or DSpark drafter", reference=True
            ),
            "format": Option(
                str,
                "'dflash' or 'dspark' (default: read from its config)",
                None,
                lambda v: v in ("dflash", "dspark"),
            ),
        },
    }.items()
}
