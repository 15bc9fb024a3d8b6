"""Loaders refuse what they cannot read.

A published checkpoint that loads while part of it is ignored drafts badly and nobody
notices (every draft is still verified, so only speed suffers). So each loader of a
published format accounts for every tensor and every config field: used, known to be
harmless (a one-line warning names what is skipped), or an error naming it.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Iterable

log = logging.getLogger("mlxspec.drafter")
# Fields every Hugging Face config may carry that say nothing about the forward pass.
HF_METADATA = frozenset(
    {
        "_name_or_path",
        "architectures",
        "auto_map",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "dtype",
        "torch_dtype",
        "transformers_version",
        "use_cache",
        "initializer_range",
        "attention_dropout",
        "model_type",
        "max_position_embeddings",
        "tie_word_embeddings",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "pretraining_tp",
    }
)


def matching(names: Iterable[str], patterns: Iterable[str]) -> list[str]:
    """The `names` that match one of the glob `patterns`, sorted."""
    patterns = tuple(patterns)
    return sorted(n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns))


def _listed(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" (and {len(names) - limit} more)" if len(names) > limit else "")


def unread_tensors(
    names: Iterable[str], used: Iterable[str], harmless: Iterable[str], what: str
) -> str | None:
    """The error line for tensors among `names` that are neither `used` nor matched by
    a `harmless` pattern (None: none); harmless ones left unused get a warning."""
    left = sorted(set(names) - set(used))
    skipped = matching(left, harmless)
    unknown = [n for n in left if n not in skipped]
    if unknown:
        return f"{what} has {len(unknown)} tensor(s) mlxspec does not read: {_listed(unknown)}"
    if skipped:
        log.warning("%s: not used (harmless): %s", what, _listed(skipped))
    return None


def unknown_fields(config: dict, understood: Iterable[str], what: str) -> str | None:
    """The error line for `config` fields neither `understood` nor metadata (None: none)."""
    known = set(understood) | HF_METADATA
    unknown = sorted(k for k in config if k not in known)
    if unknown:
        return f"{what} sets {_listed(unknown)}, which mlxspec does not understand"
    return None
