"""The tool and question the tool-call tests share, and the real chat templates they
render (quoted with their sources in templates/README.md)."""

from __future__ import annotations

from pathlib import Path

TEMPLATES = Path(__file__).parent / "templates"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
ASK = [{"role": "user", "content": "Weather in Paris and Rome?"}]
CALLED = [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
