"""The chat's widgets: messages, the provenance-coloured answer and its folding thinking,
the legend, the status bar.

Provenance styles live in chat.tcss as component classes (`provenance--accepted`, ...), so
the answer text, the legend and any theme agree on them.
"""

from __future__ import annotations

import time

from rich.style import Style
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.reactive import reactive
from textual.timer import Timer
from textual.widget import Widget
from textual.widgets import Markdown, Static

from tui.answer import ACCEPTED, KINDS, OWN, REJECTED, Answer

PROVENANCE_CLASSES = {f"provenance--{kind}" for kind in KINDS}
FADE_TICK_SECONDS = 0.25


def provenance_styles(widget: Widget) -> dict[str, Style]:
    return {
        kind: widget.get_component_rich_style(f"provenance--{kind}", partial=True) for kind in KINDS
    }


class UserMessage(Static):
    def __init__(self, content: str) -> None:
        super().__init__(content, markup=False)


class AnswerText(Widget):
    """The streaming answer, coloured by provenance, with fading ghosts of rejected drafts."""

    COMPONENT_CLASSES = PROVENANCE_CLASSES
    REASONING = False  # which part of the answer it shows
    show_rejected = reactive(False, layout=True)

    def __init__(self, answer: Answer, show_rejected: bool) -> None:
        super().__init__()
        self.answer = answer
        self.set_reactive(AnswerText.show_rejected, show_rejected)
        self._fade: Timer | None = None
        self._styles: dict[str, Style] | None = None  # refresh() drops Textual's own cache

    def notify_style_update(self) -> None:
        super().notify_style_update()
        self._styles = None  # the theme or the stylesheet changed

    def rich_text(self) -> Text:
        if self._styles is None:
            self._styles = provenance_styles(self)
        return self.answer.to_text(
            self._styles, self.show_rejected, time.monotonic(), self.REASONING
        )

    def render(self) -> Text:
        return self.rich_text()

    def redraw(self) -> None:
        """Repaint; lay the screen out again only when the answer's height changed.

        A layout costs far more than a repaint (it measures the whole screen), and most
        tokens do not start a new line.
        """
        self.refresh()
        width = self.content_size.width
        size = self.app.size
        if not width or self.get_content_height(size, size, width) != self.content_size.height:
            self.refresh(layout=True)

    def ghost_added(self) -> None:
        """Keep repainting while ghosts fade; stop when none is left to fade."""
        if self._fade is None:
            self._fade = self.set_interval(FADE_TICK_SECONDS, self._fade_tick)

    def _fade_tick(self) -> None:
        self.redraw()
        if not self.answer.ghosts_showing(time.monotonic()):
            self._fade.stop()
            self._fade = None


class ThinkingText(AnswerText):
    """The model's reasoning, dimmed (chat.tcss): shown as it streams, folded to one line
    once the answer starts unless `unfolded`."""

    REASONING = True
    unfolded = reactive(False, layout=True)

    def __init__(self, answer: Answer, show_rejected: bool, unfolded: bool) -> None:
        super().__init__(answer, show_rejected)
        self.set_reactive(ThinkingText.unfolded, unfolded)

    @property
    def folded(self) -> bool:
        return self.answer.answer_started and not self.unfolded

    def rich_text(self) -> Text:
        if self.folded:
            return Text(f"▸ Thought for {self.answer.reasoning_tokens} tokens (ctrl+g shows)")
        return super().rich_text()


class AnswerView(Vertical):
    """One assistant turn: its thinking, if any, apart; provenance view while streaming,
    markdown once finished."""

    def __init__(
        self, answer: Answer, model: str, show_rejected: bool, show_thinking: bool
    ) -> None:
        super().__init__()
        self.answer, self.model = answer, model
        self.thinking = ThinkingText(answer, show_rejected, show_thinking)
        self.body = AnswerText(answer, show_rejected)

    def compose(self) -> ComposeResult:
        yield Static(self.model, classes="who", markup=False)
        yield self.thinking
        yield self.body
        yield Markdown()
        yield Static(classes="meta", markup=False)

    def on_mount(self) -> None:
        if self.answer.finished:
            self.finish()

    def ghost_added(self) -> None:
        self.thinking.ghost_added()
        self.body.ghost_added()

    def redraw(self) -> None:
        """Repaint what streamed in (see AnswerText.redraw)."""
        self.set_class(self.answer.has_reasoning, "-thinking")
        self.thinking.redraw()
        self.body.redraw()

    def finish(self) -> None:
        """Show the clean markdown and a one-line summary (or why it stopped)."""
        self.add_class("-finished")
        self.query_one(Markdown).update(self.answer.text)
        self.query_one(".meta", Static).update(summary(self.answer))
        self.set_class(self.answer.cancelled, "-cancelled")
        self.set_class(self.answer.error is not None, "-failed")
        self.redraw()


def summary(answer: Answer) -> str:
    if answer.error is not None:
        return f"failed: {answer.error}"
    record = answer.record
    parts = ["cancelled"] if answer.cancelled else []
    if record is not None:
        thought = record.get("reasoning_tokens")
        tokens = f"{record['completion_tokens']} tokens"
        tokens += f" ({thought} thinking)" if thought else ""
        speed = f"{tokens}, {record['tokens_per_second']:.1f} tok/s"
        if record.get("estimated_speedup"):  # records saved before it existed lack it
            speed += f" ({record['estimated_speedup']:.2f}× plain)"
        parts.append(speed)
        if record["drafted"]:
            parts.append(
                f"{record['proposer']}: {record['accepted']}/{record['drafted']} drafts accepted"
            )
    return " · ".join(parts)


class Legend(Widget):
    COMPONENT_CLASSES = PROVENANCE_CLASSES

    def render(self) -> Text:
        styles = provenance_styles(self)
        return Text.assemble(
            ("accepted draft", styles[ACCEPTED]),
            "  ",
            ("target's own", styles[OWN]),
            "  ",
            ("rejected draft", styles[REJECTED]),
        )


class RoundsLabel(Static):
    """Says what the sparkline beside it plots, and its scale."""

    def show(self, accepted_lengths: list[int]) -> None:
        top = max(accepted_lengths, default=0)
        self.update(f"drafts kept per round (last {len(accepted_lengths)}, top = {top}):")


class StatusBar(Widget):
    """Model, proposer of the last round, k, acceptance, speed and the machine."""

    model = reactive("")
    note = reactive("")  # long work in progress (loading...), shown instead of the stats
    proposer = reactive("")  # the one the user chose
    temperature = reactive(0.0)
    round_proposer = reactive("")  # the one that drafted the last round (a chain's member)
    k = reactive(0)
    acceptance = reactive(0.0)
    mean_accepted = reactive(0.0)
    rate = reactive(0.0)
    speedup = reactive(0.0)  # vs plain decoding, load-invariant (mlxspec/speedup.py)
    machine = reactive("")

    def show(self, answer: Answer) -> None:
        step = answer.last_step
        if step is not None:
            self.round_proposer, self.k = step.proposer, step.drafted
        self.acceptance = answer.acceptance_rate
        self.mean_accepted = answer.mean_accepted_length
        self.rate = answer.tokens_per_second
        self.speedup = answer.estimated_speedup

    def render(self) -> str:
        if self.note:
            return f"{self.model} │ {self.note}"
        drafting = self.proposer
        if self.round_proposer and self.round_proposer not in (self.proposer, "none"):
            drafting += f" → {self.round_proposer}"
        sampling = f"T={self.temperature:g}" if self.temperature else "greedy"
        if self.speedup:
            speed = f"{self.rate:.1f} tok/s · {self.speedup:.2f}× plain"
        else:  # nothing generated yet
            speed = "speed: from the first answer"
        return (
            f"{self.model} {sampling} │ {drafting} k={self.k} │ accepted {self.acceptance:.0%}, "
            f"{self.mean_accepted:.1f}/round │ {speed} │ {self.machine}"
        )
