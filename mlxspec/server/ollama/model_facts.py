"""What Ollama's model endpoints say of a model (`/api/tags`, `/api/show`, `/api/ps`), as
its clients parse them: Zed reads every `details` field as a string, VS Code Copilot reads
`model_info["<architecture>.context_length"]` and `capabilities`, Continue looks for
`.Suffix` in `template` to decide the model can fill in the middle.

Facts that need the weights (architecture, size, FIM tokens, the chat template) are read
off a model while it is resident (`ModelFacts`, cheaply: a walk over its parameters) and
kept once read, so a model swapped out is still described as it was. A model never seen in
memory is described by its models.toml entry alone (its context, its defaults): listing
never loads one. `serve` loads its default model at start; a request to another (or
`/api/generate` with an empty prompt, as editors warm a model up) loads that one.
"""

from __future__ import annotations

import hashlib
import weakref
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from mlx.utils import tree_flatten
from mlx_lm.utils import get_total_parameters

from mlxspec.decoding.engine import Engine
from mlxspec.markup.chat_template import template_text
from mlxspec.markup.fim import FimLayout
from mlxspec.markup.output_parser import THINKING_MARKERS
from mlxspec.server.providers import ModelInfo

# The Ollama release whose API shapes this dialect follows (VS Code Copilot refuses a server
# older than 0.6.4).
OLLAMA_VERSION = "0.12.6"
UNKNOWN = "unknown"  # the architecture of a model not seen in memory
# A model stays resident until another is asked for: Ollama's "never expires" date.
NEVER = "2318-01-01T00:00:00Z"
FLOAT_LEVELS = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


@dataclass(frozen=True)
class Facts:
    """What a model in memory says of itself."""

    architecture: str = UNKNOWN
    size: int = 0  # the weights' bytes in memory
    parameters: int | None = None
    quantization: str = ""
    template: str = ""
    capabilities: tuple[str, ...] = ("completion",)

    @classmethod
    def of(cls, engine: Engine) -> Facts:
        model = engine.target.model
        return cls(
            architecture=str(getattr(model, "model_type", None) or UNKNOWN),
            size=sum(value.nbytes for _, value in tree_flatten(model.parameters())),
            parameters=get_total_parameters(model),
            quantization=_quantization(engine.weights.get("held", "")),
            template=_template(engine),
            capabilities=capabilities(engine),
        )


class ModelFacts:
    """The facts of each model seen in memory, read once per load (`seen`)."""

    def __init__(self):
        self._known: dict[str, tuple[weakref.ref, Facts]] = {}

    def seen(self, name: str | None, engine: Engine | None) -> None:
        """Read the resident model's facts, unless this engine's are already read."""
        if name is None or engine is None:
            return
        known = self._known.get(name)
        if known is None or known[0]() is not engine:
            self._known[name] = (weakref.ref(engine), Facts.of(engine))

    def of(self, name: str) -> Facts:
        known = self._known.get(name)
        return Facts() if known is None else known[1]


def timestamp(when: datetime) -> str:
    """RFC 3339 in UTC, as Ollama's Go server writes time."""
    return when.isoformat().replace("+00:00", "Z")


def listing(info: ModelInfo, facts: Facts, since: datetime) -> dict[str, Any]:
    """A model as `/api/tags` lists it."""
    return {
        "name": info.name,
        "model": info.name,
        "modified_at": timestamp(since),
        "size": facts.size,
        "digest": _digest(info.name),
        "details": details(facts),
    }


def running(info: ModelInfo, facts: Facts) -> dict[str, Any]:
    """The resident model as `/api/ps` lists it (unified memory: all of it on the GPU)."""
    return {
        "name": info.name,
        "model": info.name,
        "size": facts.size,
        "digest": _digest(info.name),
        "details": details(facts),
        "expires_at": NEVER,
        "size_vram": facts.size,
        "context_length": info.defaults.context,
    }


def shown(info: ModelInfo, facts: Facts, since: datetime) -> dict[str, Any]:
    """A model as `/api/show` describes it."""
    arch = facts.architecture
    model_info: dict[str, Any] = {
        "general.architecture": arch,
        "general.basename": info.name,
        f"{arch}.context_length": info.defaults.context,
    }
    if facts.parameters is not None:
        model_info["general.parameter_count"] = facts.parameters
    return {
        "license": "",
        "modelfile": f"# served by mlxspec\nFROM {info.name}\n",
        "parameters": _parameters(info),
        "template": facts.template,
        "details": details(facts),
        "model_info": model_info,
        "capabilities": list(facts.capabilities),
        "modified_at": timestamp(since),
    }


def capabilities(engine: Engine) -> tuple[str, ...]:
    """`completion` always; `insert` where the model has FIM tokens; `tools` and
    `thinking` where its chat template has them (as Ollama reads them off its template)."""
    found = ["completion"]
    if engine.fim is not None:
        found.append("insert")
    template = template_text(engine.tokenizer) or ""
    if "tools" in template:
        found.append("tools")
    markers = [start for start, _ in THINKING_MARKERS]
    if getattr(engine.tokenizer, "has_thinking", False) or any(m in template for m in markers):
        found.append("thinking")
    return tuple(found)


def details(facts: Facts) -> dict[str, Any]:
    """Every field a string (Zed's parser insists), empty where not known."""
    return {
        "parent_model": "",
        "format": "mlx",
        "family": facts.architecture,
        "families": [facts.architecture],
        "parameter_size": _parameter_size(facts.parameters),
        "quantization_level": facts.quantization,
    }


def _parameter_size(count: int | None) -> str:
    if count is None:
        return ""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= scale:
            return f"{count / scale:.1f}{unit}".replace(".0" + unit, unit)
    return str(count)


def _quantization(held: str) -> str:
    """Ollama's names for the weights as held: Q4, Q8, F16, BF16, F32."""
    if held.startswith("q"):
        return held.split(" ")[0].upper()
    return FLOAT_LEVELS.get(held.split(", ")[-1], held.upper())


def _digest(name: str) -> str:
    """A stable stand-in for Ollama's manifest digest: the name's sha256."""
    return hashlib.sha256(name.encode()).hexdigest()


def _parameters(info: ModelInfo) -> str:
    """The model's defaults, one `name value` a line, as Ollama writes Modelfile
    parameters (Continue reads num_ctx from here)."""
    defaults = info.defaults
    values = {
        "num_ctx": defaults.context,
        "num_predict": defaults.max_tokens,
        "temperature": defaults.temperature,
        "top_p": defaults.top_p,
        "top_k": defaults.top_k,
    }
    return "\n".join(f"{name:<30} {value}" for name, value in values.items())


def _template(engine: Engine) -> str:
    """The model's prompt template: its fill-in-the-middle layout in Ollama's template
    language (`{{ .Prompt }}`, `{{ .Suffix }}`) where it has FIM tokens, then its chat
    template as the model ships it (Jinja)."""
    chat = template_text(engine.tokenizer) or ""
    if engine.fim is None:
        return chat
    return _fim_template(engine.fim, engine.tokenizer) + ("\n" + chat if chat else "")


def _fim_template(layout: FimLayout, tokenizer) -> str:
    text = tokenizer.convert_ids_to_tokens
    prefix = text(layout.prefix) + "{{ .Prompt }}"
    suffix = text(layout.suffix) + "{{ .Suffix }}"
    middle = text(layout.middle) if layout.middle is not None else ""
    hole = suffix + prefix if layout.suffix_first else prefix + suffix
    return "{{- if .Suffix }}" + hole + middle + "{{- else }}{{ .Prompt }}{{- end }}"
