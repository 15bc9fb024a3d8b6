"""Modal screens: settings (model, proposer, temperature, thinking) and opening a saved
conversation."""

from __future__ import annotations

from dataclasses import dataclass

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, OptionList, Select, Switch
from textual.widgets.option_list import Option

from mlxspec.registry.models_toml import Registry
from tui.store import Conversation


@dataclass(frozen=True)
class Choices:
    model: str
    proposer: str
    temperature: float
    thinking: bool  # the chat template's enable_thinking


class SettingsScreen(ModalScreen[Choices | None]):
    AUTO_FOCUS = "#model"
    BINDINGS = [("escape", "dismiss", "Close")]

    def __init__(self, registry: Registry, current: Choices) -> None:
        super().__init__()
        self.registry, self.current = registry, current

    def compose(self) -> ComposeResult:
        models = [(name, name) for name in self.registry.entries]
        with Vertical(id="dialog"):
            yield Label("Model")
            yield Select(models, value=self.current.model, allow_blank=False, id="model")
            yield Label("Proposer")
            yield Select(
                self._proposers(self.current.model),
                value=self.current.proposer,
                allow_blank=False,
                id="proposer",
            )
            yield Label("Temperature (0 = greedy)")
            yield Input(str(self.current.temperature), type="number", id="temperature")
            with Horizontal(id="thinking-row"):
                yield Switch(self.current.thinking, id="thinking")
                yield Label("Thinking (the template's enable_thinking)")
            with Horizontal(id="buttons"):
                yield Button("Apply", variant="primary", id="apply")
                yield Button("Cancel", id="cancel")

    def _proposers(self, model: str) -> list[tuple[str, str]]:
        return [(name, name) for name in self.registry.get(model).proposer_names]

    def on_select_changed(self, event: Select.Changed) -> None:
        if event.select.id == "model":
            entry = self.registry.get(str(event.value))
            proposers = self.query_one("#proposer", Select)
            proposers.set_options(self._proposers(entry.name))
            proposers.value = entry.default_proposer

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "cancel":
            self.dismiss(None)
            return
        try:
            temperature = float(self.query_one("#temperature", Input).value)
        except ValueError:
            temperature = -1.0
        if not temperature >= 0:
            self.notify("temperature must be a number >= 0", severity="error")
            return
        self.dismiss(
            Choices(
                str(self.query_one("#model", Select).value),
                str(self.query_one("#proposer", Select).value),
                temperature,
                self.query_one("#thinking", Switch).value,
            )
        )


class OpenScreen(ModalScreen[Conversation | None]):
    AUTO_FOCUS = "OptionList"
    BINDINGS = [("escape", "dismiss", "Close")]

    def __init__(self, conversations: list[Conversation]) -> None:
        super().__init__()
        self.conversations = conversations

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label("Open a saved conversation")
            yield OptionList(
                *(
                    Option(Text(f"{c.title}  ({c.updated}, {len(c.messages)} messages)"), str(i))
                    for i, c in enumerate(self.conversations)
                )
            )

    def on_mount(self) -> None:
        self.query_one(OptionList).highlighted = 0  # enter opens the most recent

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(self.conversations[int(event.option.id)])
