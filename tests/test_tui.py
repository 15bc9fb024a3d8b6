"""The chat app and `chat --plain`, driving the real engine on tiny random models.

The tiny llama (seed 0) keeps repeating itself, so prompt lookup gets drafts accepted
(and some rejected): every provenance appears in a short answer.
"""

import mlxspec  # noqa: F401, I001  (OpenBLAS before mlx.core)

import asyncio
import contextlib
import json
import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from click.testing import CliRunner
from textual.command import CommandList
from textual.widgets import Input, LoadingIndicator, Markdown, Select
from tiny_models import byte_tokenizer, tiny_model

from mlxspec.registry import runtime as runtime_module
from mlxspec.markup.display import PieceReader
from mlxspec.cli import main
from mlxspec.decoding.engine import Engine
from mlxspec.events import Accepted, Bonus, Corrected, Done, Rejected, Step
from mlxspec.models.loading import LoadedModel, LoadError
from mlxspec.decoding.verify_cost import VerifyCost
from mlxspec.registry.models_toml import load_registry
from mlxspec.registry.runtime import Runtime
from tui import answer as answer_module
from tui.answer import ACCEPTED, OWN, REJECTED, Answer
from tui.app import ChatApp
from tui.screens import OpenScreen, SettingsScreen
from tui.widgets import AnswerView, RoundsLabel, UserMessage, provenance_styles

PROMPT = "abcd" * 6
MODELS_TOML = """
default = "tiny"

[models.tiny]
target = "./tiny"
[models.tiny.defaults]
max_tokens = 40

[models.other]
target = "./other"
[models.other.defaults]
max_tokens = 20
temperature = 0.5

[models.missing]
target = "./missing"
"""
SEEDS = {"tiny": 0, "other": 1}
CPU_LIKE_COST = VerifyCost({1: 1.0, 2: 1.13, 4: 1.39, 8: 1.55, 16: 2.05, 32: 3.22}, 0.05)


@dataclass
class Call:
    messages: list
    proposer: str
    template_kwargs: dict = field(default_factory=dict)
    events: list = field(default_factory=list)


@dataclass
class TinyModels:
    """An `open_runtime` for tiny models that records what the engine was asked and said."""

    pause_after: int | None = None  # hold the answer after this many events...
    resume: threading.Event = field(default_factory=threading.Event)  # ...until this is set
    load_gate: threading.Event | None = None  # loads wait for it, when set
    fail_after: int | None = None  # raise after this many events
    calls: list[Call] = field(default_factory=list)
    opened: list[str] = field(default_factory=list)

    def __call__(self, entry, notify):
        self.opened.append(entry.name)
        if self.load_gate is not None:
            self.load_gate.wait(timeout=10)
        loaded = self.loaded(entry)
        runtime = Runtime(entry, loaded, notify)
        # A fixed verify cost instead of a timed calibration: the same drafts every run.
        runtime.engine = Engine(
            loaded.model, loaded.tokenizer, entry.name, verify_cost=CPU_LIKE_COST, notify=notify
        )
        runtime.engine.stream = self._recording(runtime.engine.stream)
        return runtime

    def loaded(self, entry) -> LoadedModel:
        if entry.name not in SEEDS:
            raise LoadError(f"no model weights at {entry.target}")
        model = tiny_model("llama", seed=SEEDS[entry.name])
        return LoadedModel(
            entry.target, model, byte_tokenizer(), Path(entry.target), "float32", False, {}
        )

    def _recording(self, stream):
        def recording_stream(prompt, settings=None, proposer=None):
            call = Call(prompt.messages, proposer, prompt.template_kwargs)
            self.calls.append(call)
            with contextlib.closing(stream(prompt, settings, proposer)) as events:
                for event in events:
                    if len(call.events) == self.pause_after:
                        self.resume.wait(timeout=10)
                    if len(call.events) == self.fail_after:
                        raise RuntimeError("the accelerator caught fire")
                    call.events.append(event)
                    yield event

        return recording_stream


@pytest.fixture
def models(tmp_path, monkeypatch):
    monkeypatch.setenv("MLXSPEC_DATA", str(tmp_path / "data"))
    monkeypatch.setenv("MLXSPEC_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "models.toml"
    path.write_text(MODELS_TOML)
    monkeypatch.setenv("MLXSPEC_MODELS", str(path))
    return TinyModels()


def run_app(models, scenario, **options):
    """Run `scenario(app, pilot)` inside the app, headless."""

    async def run():
        app = ChatApp(load_registry(), open_runtime=models, **options)
        app.notes = []  # (severity, message) of each notification
        show = app.notify

        def notify(message, **kwargs):
            app.notes.append((kwargs.get("severity", "information"), message))
            show(message, **kwargs)

        app.notify = notify
        async with app.run_test(size=(120, 40)) as pilot:
            await until(pilot, lambda: app.model_ready)
            await scenario(app, pilot)
        return app

    return asyncio.run(run())


async def until(pilot, condition, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        await pilot.pause(0.02)


async def ask(app, pilot, prompt=PROMPT):
    """Send a prompt and wait for the whole answer."""
    asked = len(app.conversation.messages)
    app.query_one(Input).value = prompt
    await pilot.press("enter")
    await until(pilot, lambda: len(app.conversation.messages) == asked + 2)
    return app.current


def output_kinds(events):
    """The provenance of each character of the answer, from the engine's events."""
    kinds = []
    for event in events:
        if isinstance(event, (Accepted, Corrected, Bonus)):
            kinds += [ACCEPTED if isinstance(event, Accepted) else OWN] * len(event.text)
    return kinds


def style_per_char(text):
    styles = [None] * len(text.plain)
    for span in text.spans:
        for i in range(span.start, span.end):
            styles[i] = span.style
    return styles


def test_answer_streams_in_with_accepted_drafts_styled_apart(models, monkeypatch):
    monkeypatch.setattr(answer_module, "GHOST_SECONDS", 0.0)  # no ghosts: the answer alone

    async def scenario(app, pilot):
        view = await ask(app, pilot)
        events = models.calls[-1].events
        done = events[-1]
        assert isinstance(done, Done) and done.record.accepted > 0
        assert models.calls[-1].messages == [{"role": "user", "content": PROMPT}]

        text = view.body.rich_text()
        assert text.plain == done.text
        styles = provenance_styles(view.body)
        assert styles[ACCEPTED] != styles[OWN]
        kinds = output_kinds(events)
        assert ACCEPTED in kinds and OWN in kinds
        assert [s == styles[ACCEPTED] for s in style_per_char(text)] == [
            k == ACCEPTED for k in kinds
        ]
        # One character per byte token here, so the accepted-styled characters count the
        # accepted tokens: exactly the record's.
        assert len(done.text) == len(done.token_ids)
        accepted_styled = sum(s == styles[ACCEPTED] for s in style_per_char(text))
        assert accepted_styled == done.record.accepted
        # ...and the screen shows both colours.
        colours = {seg.style.color for seg in view.body.render_line(0) if seg.text.strip()}
        assert {styles[ACCEPTED].color, styles[OWN].color} <= colours

        steps = [e for e in events if isinstance(e, Step)]
        assert app.status.k == steps[-1].drafted
        assert app.status.acceptance == pytest.approx(done.record.acceptance_rate)
        assert app.status.rate == pytest.approx(done.record.tokens_per_second, rel=1e-3)
        assert app.status.rate > 0
        # The speedup is the engine's load-invariant estimate, the record's own figure.
        assert app.status.speedup == pytest.approx(done.record.speedup_estimate.value, rel=1e-3)
        assert f"{app.status.speedup:.2f}× plain" in app.status.render()
        rounds = [s.accepted for s in steps if s.drafted]
        label = str(app.query_one(RoundsLabel).render())
        assert label.startswith("drafts kept per round") and f"top = {max(rounds)}" in label
        assert "tokens" in str(view.query_one(".meta").render())

    run_app(models, scenario)


def test_rejected_drafts_are_ghosts_where_tried_and_can_be_kept(models):
    async def scenario(app, pilot):
        await pilot.press("ctrl+r")  # keep rejected drafts visible
        view = await ask(app, pilot)
        events = models.calls[-1].events
        rejected = [e.text for e in events if isinstance(e, Rejected) and e.text]
        assert rejected

        text = view.body.rich_text()
        ghost = provenance_styles(view.body)[REJECTED]
        assert ghost.strike
        ghost_text = "".join(c for c, s in zip(text.plain, style_per_char(text)) if s == ghost)
        assert ghost_text == "".join(rejected)
        # Each ghost sits where it was tried: after the accepted drafts of its round,
        # right before the target's correction.
        for segment, after in zip(view.answer.segments, view.answer.segments[1:]):
            if segment.kind == REJECTED:
                assert after.kind == OWN

        await pilot.press("ctrl+r")
        assert view.body.show_rejected is False
        later = view.answer.to_text(provenance_styles(view.body), False, math.inf)
        assert later.plain == events[-1].text  # faded out: the answer alone

    run_app(models, scenario)


def test_escape_cancels_mid_answer_and_keeps_the_partial_text(models):
    models.pause_after = 6

    async def scenario(app, pilot):
        app.query_one(Input).value = PROMPT
        await pilot.press("enter")
        shown = models.calls[-1].events[:6]
        partial = "".join(e.text for e in shown if isinstance(e, (Accepted, Corrected, Bonus)))
        await until(pilot, lambda: app.current.answer.text == partial != "")
        await pilot.press("escape")
        models.resume.set()
        await until(pilot, lambda: not app.busy)
        view = app.current
        assert view.answer.cancelled and view.answer.record is None
        assert view.answer.text == partial  # nothing after the escape is shown
        assert view.has_class("-cancelled")
        assert "cancelled" in str(view.query_one(".meta").render())
        saved = app.conversation.messages[-1]
        assert saved["cancelled"] and saved["content"] == partial

        # The engine is left consistent: the next answer runs to the end.
        view = await ask(app, pilot, "again")
        assert view.answer.record is not None and not view.answer.cancelled

    run_app(models, scenario)


def test_switching_proposer_from_the_command_palette(models):
    async def scenario(app, pilot):
        assert app.proposer == "prompt-lookup"
        await pilot.press("ctrl+p")
        await pilot.press(*"Proposer: none")
        hits = app.screen.query_one(CommandList)
        await until(
            pilot, lambda: hits.option_count and "none" in str(hits.get_option_at_index(0).prompt)
        )
        await pilot.press("enter")
        await until(pilot, lambda: app.proposer == "none")
        assert app.status.proposer == "none"
        await ask(app, pilot)
        record = models.calls[-1].events[-1].record
        assert models.calls[-1].proposer == "none"
        assert record.proposer == "none" and record.drafted == 0

    run_app(models, scenario)


def test_settings_switch_model_loading_in_the_background(models):
    async def scenario(app, pilot):
        await ask(app, pilot)
        await pilot.press("ctrl+s")
        await until(pilot, lambda: isinstance(app.screen, SettingsScreen))
        app.screen.query_one("#model", Select).value = "other"
        await pilot.pause()
        assert app.screen.query_one("#proposer", Select).value == "prompt-lookup"
        models.load_gate = threading.Event()
        await pilot.click("#apply")
        # Loading runs in the worker: the screen still answers and shows progress.
        assert not app.model_ready and app.status.note.startswith("loading other")
        assert app.query_one(LoadingIndicator).display
        await pilot.press(*"typed while loading")
        assert app.query_one(Input).value == "typed while loading"
        models.load_gate.set()
        await until(pilot, lambda: app.model_ready)
        assert models.opened == ["tiny", "other"]
        assert app.temperature == 0.0  # the dialog's value, not the entry's default
        view = await ask(app, pilot, "and now?")
        assert view.model == "other" and "other" in app.status.render()
        # The conversation went on: the new model got the whole chat.
        assert [m["role"] for m in models.calls[-1].messages] == ["user", "assistant", "user"]

    run_app(models, scenario)


def test_a_model_that_fails_to_load_is_a_notification_and_the_chat_stays(models):
    async def scenario(app, pilot):
        await ask(app, pilot)
        app.switch_model("missing")
        await until(pilot, lambda: app.notes)
        severity, message = app.notes[-1]
        assert severity == "error" and "no model weights" in message
        assert len(app.query(UserMessage)) == 1 and len(app.query(AnswerView)) == 1
        assert len(app.conversation.messages) == 2
        assert "no model loaded" in app.status.render()

    run_app(models, scenario)


def test_a_failed_generation_is_a_notification_and_is_saved(models):
    models.fail_after = 5

    async def scenario(app, pilot):
        view = await ask(app, pilot)
        assert view.answer.error == "the accelerator caught fire"
        assert view.has_class("-failed")
        assert ("error", "generation failed: the accelerator caught fire") in app.notes
        saved = json.loads(app.conversation.path.read_text())
        assert saved["messages"][0]["content"] == PROMPT
        assert saved["messages"][1]["error"] == "the accelerator caught fire"

    run_app(models, scenario)


def test_conversations_are_saved_reopened_and_exported(models, tmp_path):
    async def scenario(app, pilot):
        first = await ask(app, pilot)
        second = await ask(app, pilot, "tell me more")
        # Multi-turn: the second request carried the whole chat.
        assert models.calls[-1].messages == [
            {"role": "user", "content": PROMPT},
            {"role": "assistant", "content": first.answer.text},
            {"role": "user", "content": "tell me more"},
        ]
        files = list((tmp_path / "data" / "conversations").glob("*.json"))
        assert [f.stem for f in files] == [app.conversation.id]
        answer_segments = [v.answer.to_dict()["segments"] for v in (first, second)]

        await pilot.press("ctrl+n")
        await pilot.pause()
        assert not app.query(AnswerView) and not app.conversation.messages

        await pilot.press("ctrl+o")
        await until(pilot, lambda: isinstance(app.screen, OpenScreen))
        await pilot.press("enter")
        await until(pilot, lambda: len(app.query(AnswerView)) == 2)
        views = list(app.query(AnswerView))
        assert [v.answer.to_dict()["segments"] for v in views] == answer_segments
        assert views[0].answer.text == first.answer.text and views[0].has_class("-finished")

        await pilot.press("ctrl+t")  # markdown view of finished answers
        assert views[0].query_one(Markdown).display and not views[0].body.display

        # Reopened, the chat goes on from where it was.
        await ask(app, pilot, "and then?")
        assert len(models.calls[-1].messages) == 5

        await pilot.press("ctrl+e")
        markdown = app.conversation.path.with_suffix(".md").read_text()
        assert "## You\n\ntell me more" in markdown and first.answer.text in markdown

    run_app(models, scenario)


def test_ctrl_q_quits_even_mid_answer(models):
    models.pause_after = 4

    async def scenario(app, pilot):
        app.query_one(Input).value = PROMPT
        await pilot.press("enter")
        await until(pilot, lambda: app.current.answer.text)
        threading.Timer(0.2, models.resume.set).start()  # the engine goes on after the quit
        await pilot.press("ctrl+q")

    start = time.monotonic()
    app = run_app(models, scenario)
    assert app.return_code == 0
    assert time.monotonic() - start < 10
    assert not any(isinstance(e, Done) for e in models.calls[-1].events)  # stopped early


def test_answer_places_ghosts_before_the_correction():
    answer = Answer()
    reader = PieceReader(byte_tokenizer(), "a raw prompt")  # answer text only
    for event in [
        Rejected((5, 6), "xy"),
        Accepted((1, 2), "ab"),
        Corrected((3,), "c"),
        Step("prompt-lookup", 4, 2, 0.01),
        Bonus((4,), "d"),
        Step("none", 0, 0, 0.01),
    ]:
        answer.add(event if isinstance(event, (Rejected, Step)) else reader.read(event), now=0.0)
    assert [(s.kind, s.text) for s in answer.segments] == [
        (ACCEPTED, "ab"),
        (REJECTED, "xy"),
        (OWN, "cd"),
    ]
    assert answer.text == "abcd"
    assert answer.acceptance_rate == 0.5 and answer.mean_accepted_length == 2.0
    assert answer.accepted_lengths == [2]
    styles = {ACCEPTED: "green", OWN: "", REJECTED: "strike"}
    assert answer.to_text(styles, show_rejected=False, now=0.0).plain == "abxycd"  # fresh
    assert answer.to_text(styles, show_rejected=False, now=60.0).plain == "abcd"  # faded


def test_plain_chat_reads_turns_until_quit(models, monkeypatch):
    monkeypatch.setattr(runtime_module, "open_runtime", models)
    result = CliRunner().invoke(
        main, ["chat", "--plain", "--color"], input=f"{PROMPT}\n\nmore\n/quit\nnever sent\n"
    )
    assert result.exit_code == 0, result.output
    assert [c.messages[-1]["content"] for c in models.calls] == [PROMPT, "more"]
    first = models.calls[0].events
    assert models.calls[1].messages[1] == {"role": "assistant", "content": first[-1].text}
    accepted = next(e.text for e in first if isinstance(e, Accepted))
    assert f"\x1b[32m{accepted}\x1b[0m" in result.stdout  # accepted drafts in green
    plain = CliRunner().invoke(main, ["chat", "--plain", "--no-color"], input=PROMPT)
    assert plain.exit_code == 0 and "\x1b[" not in plain.stdout
    assert plain.stdout.strip() == models.calls[-1].events[-1].text.strip()
    assert "accepted" in plain.stderr  # the per-answer summary goes to stderr


def test_chat_rejects_an_unknown_proposer_before_loading(models, monkeypatch):
    monkeypatch.setattr(runtime_module, "open_runtime", models)
    result = CliRunner().invoke(main, ["chat", "--plain", "--proposer", "telepathy"])
    assert result.exit_code != 0 and "unknown proposer 'telepathy'" in result.output
    assert models.opened == []


@pytest.mark.parametrize("after", [5, 6], ids=["mid-round", "after a round"])
def test_escape_computes_no_round_after_it(after, monkeypatch):
    """The chat's Escape ends the answer between two events: the engine runs no round
    after it (counted), whichever event of a round it came after."""
    from types import SimpleNamespace

    from mlxspec.batch.single import SingleCaches
    from mlxspec.decoding.engine import GenerationSettings
    from tui.worker import local_stream

    engine = Engine(tiny_model("llama", seed=1), byte_tokenizer(), "llama")
    verify, passes = SingleCaches.verify, []
    monkeypatch.setattr(SingleCaches, "verify", lambda *a: passes.append(1) or verify(*a))
    escape, seen = threading.Event(), []
    settings = GenerationSettings(max_tokens=40, k=0)
    for event in local_stream(
        SimpleNamespace(engine=engine), [5, 6, 7], settings, "none", escape.is_set
    ):
        seen.append(event)
        if len(seen) == after:  # plain rounds of two events: the token, then its Step
            escape.set()
            ran = len(passes)
    assert escape.is_set() and len(passes) == ran
