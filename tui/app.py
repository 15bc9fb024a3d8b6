"""`mlxspec chat`: a Textual chat that shows speculation at work.

The app owns what the screen shows; one thread worker (tui.worker.EngineThread) owns the
model. Answers arrive as the engine's events, posted back as messages, so the screen
never waits on the model and escape can stop an answer between two rounds.

Sharded (`chat --ranks`), the app is rank 0's front end: answers go through the rank
session (the other ranks follow), the model is the one every rank loaded at start, and
a lost rank ends the chat (`lose_ranks`) instead of leaving it waiting.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from functools import partial
from typing import TYPE_CHECKING

from textual import work
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.reactive import reactive
from textual.screen import Screen
from textual.widgets import Footer, Header, Input, LoadingIndicator, Sparkline

if TYPE_CHECKING:
    from mlxspec.distributed.rank import RankSession

from mlxspec import blas, device
from mlxspec.events import Rejected
from mlxspec.registry.models_toml import ModelEntry, Registry
from mlxspec.registry.runtime import open_runtime as default_open_runtime
from tui import store
from tui.answer import Answer
from tui.screens import Choices, OpenScreen, SettingsScreen
from tui.store import Conversation
from tui.widgets import (
    AnswerText,
    AnswerView,
    Legend,
    RoundsLabel,
    StatusBar,
    ThinkingText,
    UserMessage,
)
from tui.worker import (
    AnswerJob,
    Ended,
    EngineThread,
    Loaded,
    LoadFailed,
    LoadJob,
    Progress,
    Streamed,
    generation_settings,
)

SPARKLINE_ROUNDS = 60  # accepted lengths of the last rounds, in the sparkline
REDRAW_SECONDS = 1 / 20  # a streaming answer is redrawn at most this often
TEMPERATURE_PRESETS = (0.0, 0.7, 1.0)


def thinks_by_default(entry: ModelEntry) -> bool:
    """The model's enable_thinking (models.toml or --chat-template-args), else on."""
    return bool(entry.defaults.chat_template_kwargs.get("enable_thinking", True))


class ChatApp(App):
    CSS_PATH = "chat.tcss"
    TITLE = "mlxspec chat"
    AUTO_FOCUS = "#prompt"
    BINDINGS = [
        Binding("ctrl+q", "quit", "Quit", priority=True),
        Binding("escape", "cancel", "Stop"),
        Binding("ctrl+n", "new_chat", "New"),
        Binding("ctrl+o", "open", "Open"),
        Binding("ctrl+e", "export", "Export", priority=True),
        Binding("ctrl+s", "settings", "Settings"),
        Binding("ctrl+t", "toggle_view", "Markdown"),
        Binding("ctrl+r", "toggle_ghosts", "Ghosts"),
        Binding("ctrl+g", "toggle_thinking", "Thinking"),
    ]

    proposer = reactive("")
    temperature = reactive(0.0)
    busy = reactive(False)  # an answer is streaming
    model_ready = reactive(False)
    markdown_view = reactive(False)
    keep_rejected = reactive(False)
    thinking = reactive(True)  # the chat template's enable_thinking, from the next answer
    show_thinking = reactive(False)  # answers' thinking unfolded, not one summary line

    def __init__(
        self,
        registry: Registry,
        model: str | None = None,
        proposer: str | None = None,
        open_runtime: Callable = default_open_runtime,
        ranks: RankSession | None = None,
    ):
        """`ranks`: this process is rank 0 of a sharded target; `open_runtime` then
        loads this process's shard (every rank loads in step)."""
        super().__init__()
        self.ranks = ranks
        self.failure: str | None = None  # why a sharded chat had to end
        self.registry = registry
        self.entry = registry.get(model)
        self.entry.proposer(proposer)  # an unknown name fails here, before any loading
        self.set_reactive(ChatApp.proposer, proposer or self.entry.default_proposer)
        self.set_reactive(ChatApp.temperature, self.entry.defaults.temperature)
        self.set_reactive(ChatApp.thinking, thinks_by_default(self.entry))
        if ranks is None:
            self.engine_thread = EngineThread(self.post_message, open_runtime)
        else:
            self.engine_thread = EngineThread(
                self.post_message, open_runtime, ranks.stream, self._end_following
            )
        self.conversation = Conversation()
        self.current: AnswerView | None = None  # the answer streaming (or the last one)
        self.job: AnswerJob | None = None
        self._redraw_due = False

    def compose(self) -> ComposeResult:
        yield Header()
        yield VerticalScroll(id="conversation")
        with Horizontal(id="info"):
            yield Legend()
            yield LoadingIndicator()
            yield RoundsLabel("drafts kept per round:", markup=False)
            yield Sparkline([], id="rounds")
        yield StatusBar()
        yield Input(placeholder="Ask something; enter sends", id="prompt")
        yield Footer()

    @property
    def status(self) -> StatusBar:
        return self.query_one(StatusBar)

    def on_mount(self) -> None:
        facts = device.describe()
        self.status.machine = f"{facts['device']} · {facts['blas'].split(' (')[0]}"
        self.status.proposer, self.status.temperature = self.proposer, self.temperature
        hint = blas.slow_blas_hint()  # why nothing gets drafted on this machine
        if hint:
            self.notify(hint, severity="warning", timeout=20, markup=False)
        self.run_engine()
        self.load(self.entry)

    @work(thread=True, name="mlx")
    def run_engine(self) -> None:
        self.engine_thread.run()

    def on_unmount(self) -> None:
        self.action_cancel()
        self.engine_thread.stop()

    # --- Model -----------------------------------------------------------------------------

    def load(self, entry) -> None:
        self.entry, self.model_ready = entry, False
        self.status.model = entry.name
        self.status.note = f"loading {entry.name}"
        self.engine_thread.submit(LoadJob(entry))

    def watch_model_ready(self, ready: bool) -> None:
        self.query_one(LoadingIndicator).display = not ready

    def on_progress(self, message: Progress) -> None:
        self.status.note = message.text

    def on_loaded(self, message: Loaded) -> None:
        if message.entry.name != self.entry.name:
            return  # another model was asked for meanwhile; its load is queued
        self.model_ready = True
        self.status.note = ""

    def on_load_failed(self, message: LoadFailed) -> None:
        if self.ranks is not None:  # the other ranks cannot be asked to load another
            self.failure = f"cannot load {message.entry.name}: {message.error}"
            self.exit(return_code=1)
            return
        self.notify(
            f"cannot load {message.entry.name}: {message.error}",
            severity="error",
            markup=False,
            timeout=15,
        )
        self.status.note = "no model loaded; pick one with ctrl+s"
        self.query_one(LoadingIndicator).display = False

    def switch_model(
        self, name: str, proposer: str | None = None, temperature=None, thinking=None
    ) -> None:
        if self._refuse_while_busy():
            return
        if self.ranks is not None and name != self.entry.name:
            self.notify(
                f"a sharded chat keeps {self.entry.name}: every rank loaded it at start",
                severity="warning",
                markup=False,
            )
            return
        entry = self.registry.get(name)
        self.proposer = proposer or entry.default_proposer
        self.temperature = entry.defaults.temperature if temperature is None else temperature
        self.thinking = thinks_by_default(entry) if thinking is None else thinking
        if self.ranks is None and (name != self.entry.name or not self.model_ready):
            self.load(entry)  # sharded: loaded once, in step with the other ranks

    def set_proposer(self, name: str) -> None:
        self.proposer = name
        self.notify(f"proposer {name} from the next answer")

    def set_temperature(self, temperature: float) -> None:
        self.temperature = temperature
        self.notify(f"temperature {temperature:g} from the next answer")

    def set_thinking(self, thinking: bool) -> None:
        self.thinking = thinking
        self.notify(f"thinking {'on' if thinking else 'off'} from the next answer")

    def watch_proposer(self, name: str) -> None:
        self.status.proposer = name

    def watch_temperature(self, temperature: float) -> None:
        self.status.temperature = temperature

    # --- Answers ---------------------------------------------------------------------------

    def on_input_submitted(self, event: Input.Submitted) -> None:
        prompt = event.value.strip()
        if not prompt or self._refuse_while_busy():
            return
        if not self.model_ready:
            self.notify("the model is not loaded yet", severity="warning")
            return
        event.input.clear()
        self.conversation.add_user(prompt)
        self.sub_title = self.conversation.title
        self.current = AnswerView(Answer(), self.entry.name, self.keep_rejected, self.show_thinking)
        conversation = self.query_one("#conversation", VerticalScroll)
        conversation.mount(UserMessage(prompt), self.current)
        conversation.anchor()
        self.query_one(Sparkline).data = []
        self.query_one(RoundsLabel).show([])
        self.status.show(self.current.answer)
        self.job = AnswerJob(
            self.conversation.engine_messages(),
            {**self.entry.defaults.chat_template_kwargs, "enable_thinking": self.thinking},
            generation_settings(self.entry, self.temperature),
            self.proposer,
        )
        self.busy = True
        self.engine_thread.submit(self.job)

    def on_streamed(self, message: Streamed) -> None:
        events = self.engine_thread.take_events()
        if not events:  # a late wake-up: an earlier one took its events
            return
        answer, now = self.current.answer, time.monotonic()
        for event in events:
            answer.add(event, now)
            if isinstance(event, Rejected):
                self.current.ghost_added()
        # Events can come faster than a screen needs redrawing: batch them.
        if not self._redraw_due:
            self._redraw_due = True
            self.current.set_timer(REDRAW_SECONDS, self.redraw_answer)  # stops with it

    def redraw_answer(self) -> None:
        self._redraw_due = False
        if self.current is None:
            return
        answer = self.current.answer
        self.current.redraw()
        self.status.note = ""  # e.g. "loading draft model ..." is over once drafts come
        self.status.show(answer)
        recent = answer.accepted_lengths[-SPARKLINE_ROUNDS:]
        self.query_one(Sparkline).data = recent
        self.query_one(RoundsLabel).show(recent)

    def on_ended(self, message: Ended) -> None:
        self.on_streamed(Streamed())  # events the last wake-up did not cover
        view, answer = self.current, self.current.answer
        answer.cancelled = message.cancelled and answer.record is None
        answer.error = message.error
        if message.error is not None:
            self.notify(f"generation failed: {message.error}", severity="error", markup=False)
        self.conversation.add_assistant(answer.text, view.model, answer.to_dict())
        self.redraw_answer()
        view.finish()
        self.busy = False
        self.save()

    def action_cancel(self) -> None:
        if self.busy and self.job is not None:
            self.job.cancel.set()

    def _end_following(self) -> None:
        """Sharded, on the engine thread as it stops: the other ranks may return (not once
        they are lost: a collective with them would wait for ever)."""
        if self.failure is None:
            self.ranks.end_following()

    def lose_ranks(self, reason: str) -> None:
        """Sharded: another rank died or is stuck (called from a watching thread). The
        chat cannot go on, so it leaves the screen; the command says why, non-zero."""
        self.failure = reason
        try:
            self.call_from_thread(self.exit, return_code=1)
        except RuntimeError:
            pass  # the app has ended already (the command reports the failure)

    def _refuse_while_busy(self) -> bool:
        if self.busy:
            self.notify("an answer is streaming; press escape to stop it first", severity="warning")
        return self.busy

    # --- Conversations ---------------------------------------------------------------------

    def save(self) -> None:
        try:
            self.conversation.save()
        except OSError as err:
            self.notify(f"cannot save the conversation: {err}", severity="error", markup=False)

    async def action_new_chat(self) -> None:
        if not self._refuse_while_busy():
            await self.show_conversation(Conversation())

    def action_open(self) -> None:
        if self._refuse_while_busy():
            return
        conversations = store.saved()
        if not conversations:
            self.notify(f"no saved conversations in {store.conversations_dir()}", markup=False)
            return
        self.push_screen(OpenScreen(conversations), self.show_conversation)

    async def show_conversation(self, conversation: Conversation | None) -> None:
        if conversation is None:
            return
        self.conversation, self.current = conversation, None
        view = self.query_one("#conversation", VerticalScroll)
        await view.remove_children()
        await view.mount_all(
            AnswerView(
                Answer.from_dict(m),
                m.get("model", "assistant"),
                self.keep_rejected,
                self.show_thinking,
            )
            if m["role"] == "assistant"
            else UserMessage(m["content"])
            for m in conversation.messages
        )
        view.anchor()
        self.sub_title = conversation.title if conversation.messages else ""

    def action_export(self) -> None:
        if not self.conversation.messages:
            self.notify("nothing to export yet")
            return
        try:
            path = self.conversation.export_markdown()
        except OSError as err:
            self.notify(f"cannot export: {err}", severity="error", markup=False)
            return
        self.notify(f"exported to {path}", markup=False)

    # --- Settings and views ----------------------------------------------------------------

    def action_settings(self) -> None:
        current = Choices(self.entry.name, self.proposer, self.temperature, self.thinking)
        self.push_screen(SettingsScreen(self.registry, current), self.apply_choices)

    def apply_choices(self, choices: Choices | None) -> None:
        if choices is not None:
            self.switch_model(
                choices.model, choices.proposer, choices.temperature, choices.thinking
            )

    def action_toggle_view(self) -> None:
        self.markdown_view = not self.markdown_view

    def watch_markdown_view(self, markdown: bool) -> None:
        self.query_one("#conversation").set_class(markdown, "-markdown")

    def action_toggle_ghosts(self) -> None:
        self.keep_rejected = not self.keep_rejected

    def watch_keep_rejected(self, keep: bool) -> None:
        for answer_text in self.query(AnswerText):
            answer_text.show_rejected = keep

    def action_toggle_thinking(self) -> None:
        self.show_thinking = not self.show_thinking

    def watch_show_thinking(self, show: bool) -> None:
        for thinking in self.query(ThinkingText):
            thinking.unfolded = show

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        yield SystemCommand("New chat", "Start an empty conversation", self.action_new_chat)
        yield SystemCommand("Open conversation", "Reopen a saved chat", self.action_open)
        yield SystemCommand("Export to markdown", "Write this chat as .md", self.action_export)
        yield SystemCommand("Settings", "Model, proposer and temperature", self.action_settings)
        for name in self.entry.proposer_names:
            yield SystemCommand(
                f"Proposer: {name}",
                "Draft with it from the next answer",
                partial(self.set_proposer, name),
            )
        for entry in self.registry.entries.values():
            yield SystemCommand(
                f"Model: {entry.name}",
                entry.description or entry.target,
                partial(self.switch_model, entry.name),
            )
        yield SystemCommand(
            f"Thinking: {'off' if self.thinking else 'on'}",
            "Sets the template's enable_thinking from the next answer",
            partial(self.set_thinking, not self.thinking),
        )
        for temperature in TEMPERATURE_PRESETS:
            yield SystemCommand(
                f"Temperature: {temperature:g}",
                "0 is greedy; any temperature stays lossless",
                partial(self.set_temperature, temperature),
            )
