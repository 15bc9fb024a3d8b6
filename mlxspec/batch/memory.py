"""How much KV a batch may hold, so that many clients cannot push a Mac into swap.

A row's cache is bounded by its request's context, but B rows of long contexts are not
bounded by anything a client sees: 8 rows x 8k tokens of a 12B model's KV is over 20 GB
next to its weights. The batch therefore admits a waiting request only while the KV it
may come to hold fits a budget (`Scheduler.kv_budget`), counted as the batch cache lays
it out: rows are right-aligned, so the cache is rows x the longest row's context
(prompt + max_tokens), plus the finished rows kept for prefix reuse, which give way
first. A request alone always runs: its own context bounds it, as without batching.

The bytes a token takes are read off the first joined row's cache (its dtype, heads and
layers as loaded, a shard's on a sharded rank), not computed from a config.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import mlx.core as mx

from mlxspec.settings import DoesNotFit

# Of the device's memory, the share weights and KV may take together by default; the
# rest is the system's and the activations'.
DEFAULT_SHARE = 0.75
GB = 1 << 30
# Of the device's memory, the share earlier prompts' caches may keep by default (serve
# --prompt-cache-bytes): a 20k-token conversation of an 8B model's KV is about 3 GB.
PROMPT_CACHE_SHARE = 0.125


def device_memory() -> int | None:
    """Bytes of memory the accelerator may use: Metal's recommended working set, else
    the machine's physical memory (None where neither is known)."""
    info = mx.device_info()
    for key in ("max_recommended_working_set_size", "memory_size"):
        if info.get(key):
            return int(info[key])
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def default_kv_budget(share: float = DEFAULT_SHARE) -> int | None:
    """`share` of the device's memory, less what is allocated now (the loaded weights):
    the KV bytes a batch may hold when `serve --kv-memory` is not given."""
    total = device_memory()
    if total is None:
        return None
    return max(0, int(total * share) - mx.get_active_memory())


def kv_budget(gigabytes: float | None) -> int | None:
    """`serve --kv-memory GB` in bytes: None (not given) for the default, 0 for none."""
    if gigabytes is None:
        return default_kv_budget()
    return int(gigabytes * GB) if gigabytes > 0 else None


def prompt_cache_bytes(given: int | None) -> int | None:
    """The bytes the prompt cache may keep: `given` (0: nothing kept), else
    PROMPT_CACHE_SHARE of the device's memory (None where it is not known: no bound
    but the pool's entry count)."""
    if given is not None:
        return max(0, given)
    total = device_memory()
    return None if total is None else int(total * PROMPT_CACHE_SHARE)


@dataclass(frozen=True)
class Holdings:
    """What a loaded model holds, in bytes: the one sum every budget check reads.

    A configuration must fit weights + drafters + KV of `context` tokens a row + the
    prompt cache's bound; when only the prompt cache is too much, it gives way (its
    bound shrinks to what is left) rather than the command refusing to start."""

    weights: int
    drafters: int
    kv_token: int  # bytes one token's KV takes, every layer, in the KV form
    kv_form: str  # `KVForm.key`, for the messages
    prompt_cache: int  # the prompt cache's bound (0: none kept)

    def fixed(self) -> int:
        return self.weights + self.drafters

    def describe(self, tokens: int, rows: int = 1, prompt_cache: bool = True) -> str:
        parts = [
            f"weights {gb(self.weights)}",
            f"drafters {gb(self.drafters)}",
            f"KV {gb(self.kv_token * tokens * rows)} ({tokens} tokens x {rows} row"
            f"{'s' if rows > 1 else ''}, {self.kv_form})",
        ]
        if prompt_cache:
            parts.append(f"prompt cache {gb(self.prompt_cache)}")
        return " + ".join(parts)


def gb(nbytes: int) -> str:
    return f"{nbytes / GB:.2f} GB"


def fit(holdings: Holdings, context: int, rows: int = 1, device: int | None = None) -> int:
    """The prompt cache's bound that lets `holdings` fit `device` bytes (default: the
    device's memory, `device_memory`) with `context` tokens of KV for each of `rows`
    rows; DoesNotFit, with the numbers, where even without a prompt cache they cannot."""
    device = device_memory() if device is None else device
    if device is None:
        return holdings.prompt_cache  # nothing known to hold it against
    needed = holdings.fixed() + holdings.kv_token * context * rows
    if needed > device:
        raise DoesNotFit(
            f"does not fit: {holdings.describe(context, rows, prompt_cache=False)} = "
            f"{gb(needed)} > {gb(device)} this device can hold; use --kv-bits 8 or 4, a "
            "smaller context or a smaller model"
        )
    return min(holdings.prompt_cache, device - needed)


def check_request(
    holdings: Holdings, prompt_tokens: int, max_tokens: int, device: int | None = None
):
    """A request whose prompt and max_tokens cannot fit beside the weights (the prompt
    cache gives way to it): DoesNotFit naming both, before any prefill."""
    device = device_memory() if device is None else device
    tokens = prompt_tokens + max_tokens
    if device is not None and holdings.fixed() + holdings.kv_token * tokens > device:
        raise DoesNotFit(
            f"this request's {prompt_tokens} prompt tokens + {max_tokens} max_tokens need "
            f"{holdings.describe(tokens, prompt_cache=False)} > {gb(device)} this device can "
            "hold; send fewer tokens or a smaller max_tokens"
        )
