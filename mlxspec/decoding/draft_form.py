"""Which form of a quantized draft model's weights drafts cheaper here, by measurement,
independently of the target's form.

A draft's price is its step beside the target's (`DraftCost.step_ratio`), and which of
its forms is cheaper depends on the machine, not on the target: on MLX's CPU backend a
0.5B Q4_K_M draft measured 0.33 of a quantized 1.5B target's step kept quantized and 0.21
dequantized (Qwen2.5-Coder, benchmarks/pairs.md), while Metal runs quantized kernels
fast. So `auto` measures both forms beside the target as it is held and keeps the
cheaper; dequantized must be DEQUANTIZE_MARGIN cheaper, since it holds 4-8x the bytes,
and must fit in memory. The decision is kept per pair, machine and target form, like
the calibrations, so a later run loads the draft straight in its form.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from mlxspec.decoding.draft_cost import DraftCost
from mlxspec.decoding.weight_form import DEQUANTIZE_MARGIN, DEQUANTIZED, QUANTIZED


@dataclass(frozen=True)
class DraftForm:
    form: str  # QUANTIZED or DEQUANTIZED: what the draft model drafts in
    reason: str  # one line for the user
    step_ratios: dict[str, float]  # each measured form's step over the target's
    partial: bool = False  # a cost measured short: decided again by the next runs
    measurements: int = 1

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> DraftForm:
        data = json.loads(text)
        return cls(
            data["form"],
            data["reason"],
            {form: float(ratio) for form, ratio in data["step_ratios"].items()},
            bool(data.get("partial", False)),
            int(data.get("measurements", 1)),
        )

    def merged(self, later: DraftForm) -> DraftForm:
        """Decided again (a partial measurement): the later decision, counted."""
        return DraftForm(
            later.form,
            later.reason,
            later.step_ratios,
            later.partial,
            self.measurements + later.measurements,
        )


def choose_draft_form(costs: dict[str, DraftCost], skipped: str = "") -> DraftForm:
    """The form to draft in from each form's measured cost (QUANTIZED alone when the
    dequantized form was not measured, `skipped` saying why)."""
    ratios = {form: cost.step_ratio for form, cost in costs.items()}
    partial = any(cost.partial for cost in costs.values())
    quantized = ratios[QUANTIZED]
    if DEQUANTIZED not in ratios:
        return DraftForm(QUANTIZED, f"quantized kept ({skipped})", ratios, partial)
    dequantized = ratios[DEQUANTIZED]
    steps = f"a step costs {quantized:.2f} of the target's quantized, {dequantized:.2f} dequantized"
    if dequantized * DEQUANTIZE_MARGIN <= quantized:
        return DraftForm(DEQUANTIZED, f"dequantized drafts cheaper ({steps})", ratios, partial)
    return DraftForm(QUANTIZED, f"quantized kept, as cheap or cheaper ({steps})", ratios, partial)
