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


def kv_token_bytes(model: Any, kv: KVForm = FLOAT) -> int:
    """Bytes one token's KV takes in `kv`'s form, every layer together, read off a cache
    that took one token (its dtype, heads and layers as loaded). Layers without a growing
    history (recurrent state) hold a fixed size and are not counted per token."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    kv = KVForm(kv.bits, kv.group_size, 0)
    kv.convert(cache)
    model(mx.array([[0]]), cache=cache)
    total = 0.0
    for layer in cache:
        keys = getattr(layer, "keys", None)
        if keys is None:
            continue
        steps = (keys[0] if isinstance(keys, (list, tuple)) else keys).shape[-2]
        total += layer.nbytes / steps
    return int(round(total))
