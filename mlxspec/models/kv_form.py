"""The form a model's KV cache is held in: float, or quantized by mlx-lm's own
`QuantizedKVCache` (`--kv-bits 4|8`, `--kv-group-size`, `--quantized-kv-start`).

mlx-lm converts a cache (`maybe_quantize_kv_cache`) once its offset reaches the start,
before whichever pass comes next. Speculation makes that moment depend on how many
drafts were accepted, and every position computed before it saw float keys, after it
quantized ones: an answer would depend on the drafts. So here the switch is a fact of
the position alone: no pass crosses the start in float form (a prefill chunk or a
verify is split there, `pieces`), the cache is converted before the first pass that
begins at or past it (`convert`), and a quantized cache is never cut back below the
start (`can_cut`): speculative greedy then equals plain greedy with the same KV form,
token for token. A start of 0 quantizes from the first token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class KVForm:
    bits: int | None = None  # None: float, as the model computes it
    group_size: int = 64
    start: int = 0  # the position from which the cache is quantized

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    @property
    def key(self) -> str:
        """What a cache's values depend on: in the prompt cache's form and the
        calibration key, so a float and a quantized cache never stand in for each other."""
        if not self.quantized:
            return "kv float"
        return f"kv q{self.bits} g{self.group_size} from {self.start}"

    def pieces(self, offset: int, n: int) -> list[tuple[int, int]]:
        """`n` tokens fed at `offset`, as (begin, end) slices of them: split at the start
        where a float cache would otherwise take tokens on both sides of it."""
        split = self.start - offset
        if self.quantized and 0 < split < n:
            return [(0, split), (split, n)]
        return [(0, n)]

    def convert(self, cache: list[Any]) -> bool:
        """Turn `cache`'s float KV layers quantized, in place, once they hold `start`
        tokens or more (mlx-lm's `to_quantized`: the same values as quantizing each token
        as it comes). Whether any layer was converted."""
        if not self.quantized:
            return False
        from mlx_lm.models.cache import KVCache  # mlx-lm loads transformers: not at import

        converted = False
        for i, layer in enumerate(cache):
            if type(layer) is KVCache and layer.offset >= self.start:
                cache[i] = layer.to_quantized(group_size=self.group_size, bits=self.bits)
                converted = True
        return converted

    def can_cut(self, cache: list[Any], length: int) -> bool:
        """Whether `cache` may be cut back to `length` tokens and stay what a fresh
        prefill of them would be: a quantized layer not below the start (its float past
        is gone)."""
        from mlx_lm.models.cache import QuantizedKVCache

        return length >= self.start or not any(isinstance(c, QuantizedKVCache) for c in cache)

    def token_bytes(self, float_bytes: int) -> int:
        """Bytes a token's KV takes in this form, from its float size at 2 bytes a value:
        packed values plus a float scale and bias per group."""
        if not self.quantized:
            return float_bytes
        values = float_bytes // 2
        return values * self.bits // 8 + (values // self.group_size) * 2 * 2


FLOAT = KVForm()


def kv_form(bits: int | None, group_size: int | None = None, start: int | None = None) -> KVForm:
    """The form the options name (None: float); a bad value is a ValueError for the user."""
    if bits is None:
        return FLOAT
    if bits not in BITS:
        raise ValueError(f"--kv-bits must be 4 or 8, not {bits}")
    group_size = 64 if group_size is None else group_size
    if group_size not in GROUP_SIZES:
        raise ValueError(f"--kv-group-size must be 32, 64 or 128, not {group_size}")
    return KVForm(bits, group_size, max(0, start or 0))


def start_of(form: tuple[str, ...]) -> int:
    """The quantized start written in a prompt-cache form's KV key (0: none)."""
    for part in form:
        if part.startswith("kv q"):
            return int(part.rsplit(" ", 1)[1])
    return 0
