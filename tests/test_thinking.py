"""A thinking model's reasoning shown apart from its answer: in the chat app, `chat
--plain` and `generate`.

The model is a tiny llama rigged (scripted.py) to think, then answer, over Qwen3's real
chat template, drafted by itself so that accepted drafts show in both parts.
"""

import mlxspec  # noqa: F401, I001  (OpenBLAS before mlx.core)

import json
from dataclasses import replace
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from scripted import scripted_model, scripted_tokenizer
from test_tui import MODELS_TOML, TinyModels, ask, run_app, style_per_char, until
from textual.widgets import Switch

from mlxspec.registry import runtime as runtime_module
from mlxspec.markup.display import Piece, PieceReader
from mlxspec.markup.chat_template import encode_chat
from mlxspec.cli import main
from mlxspec.markup.conversation import Conversation
from mlxspec.events import Accepted, Bonus, Corrected
from mlxspec.models.loading import LoadedModel
from mlxspec.proposers import DraftModel
from mlxspec.settings import GenerationSettings
from tui.answer import ACCEPTED, OWN, Answer
from tui.screens import SettingsScreen
from tui.widgets import provenance_styles

TEMPLATE = Path(__file__).parent / "templates" / "qwen3.jinja"
PIECES = ["<think>", "\nThe user", " greets me.\n", "</think>", "\n\n", "Hello", " there!"]
REASONING, ANSWER = "\nThe user greets me.\n", "Hello there!"
REASONING_TOKENS = 4  # <think>, its two pieces, </think>
THINKER_TOML = """
[models.thinker]
target = "./thinker"
default_proposer = "itself"
[models.thinker.defaults]
max_tokens = 20
[models.thinker.proposers.itself]
kind = "draft-model"
draft = "./thinker"
"""
CLOSED_BLOCK = "<think>\n\n</think>\n\n"  # what Qwen3's template adds without thinking


class ThinkingModels(TinyModels):
    """TinyModels plus `thinker`, drafted by a copy of itself (every draft accepted)."""

    def __call__(self, entry, notify, speculating=True):  # generate says whether it drafts
        runtime = super().__call__(entry, notify)
        if entry.name == "thinker":
            # Up to two drafts a round, free: several events, reasoning first, all drafting.
            runtime.engine.add_proposer(
                DraftModel(runtime.loaded.model, "itself", k_max=2, cost_hint=0.0)
            )
            # Two drafts every round, not as the policy's timings decide: under load (the
            # other test worker) a wide pass looked dear and the answer went undrafted.
            stream = runtime.engine.stream

            def drafting(prompt, settings=None, proposer=None):
                settings = replace(settings or GenerationSettings(), k=2)
                return stream(prompt, settings, proposer)

            runtime.engine.stream = drafting
        return runtime

    def loaded(self, entry) -> LoadedModel:
        if entry.name != "thinker":
            return super().loaded(entry)
        tokenizer = scripted_tokenizer(PIECES, TEMPLATE.read_text())
        (newline,) = tokenizer.encode("\n")  # Qwen3's prompts end with one
        model = scripted_model(tokenizer, PIECES, newline)
        return LoadedModel(entry.target, model, tokenizer, Path(entry.target), "float32", False, {})


@pytest.fixture
def models(tmp_path, monkeypatch):
    monkeypatch.setenv("MLXSPEC_DATA", str(tmp_path / "data"))
    monkeypatch.setenv("MLXSPEC_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "models.toml"
    path.write_text(MODELS_TOML + THINKER_TOML)
    monkeypatch.setenv("MLXSPEC_MODELS", str(path))
    monkeypatch.setattr(runtime_module, "open_runtime", ThinkingModels())
    return runtime_module.open_runtime


def written_kinds(events) -> tuple[str, list[str]]:
    """The generated text with the provenance of each character."""
    text, kinds = "", []
    for event in events:
        if isinstance(event, (Accepted, Corrected, Bonus)):
            text += event.text
            kinds += [ACCEPTED if isinstance(event, Accepted) else OWN] * len(event.text)
    return text, kinds


def test_the_chat_shows_thinking_apart_dimmed_and_folded_once_the_answer_starts(models):
    models.pause_after = 2  # the first round: reasoning only

    async def scenario(app, pilot):
        app.query_one("#prompt").value = "Hi"
        await pilot.press("enter")
        await until(pilot, lambda: app.current.answer.reasoning)
        view = app.current
        assert view.has_class("-thinking") and view.thinking.display
        assert not view.thinking.folded  # shown as it streams
        assert REASONING.startswith(view.thinking.rich_text().plain)
        assert view.body.rich_text().plain == ""
        models.resume.set()
        await until(pilot, lambda: not app.busy)

        events = models.calls[-1].events
        record = events[-1].record
        assert record.accepted > 0 and record.reasoning_tokens == REASONING_TOKENS
        assert view.answer.text == ANSWER and view.answer.reasoning == REASONING
        assert view.body.rich_text().plain == ANSWER
        # Folded to one line once the answer started; dimmed.
        assert view.thinking.rich_text().plain.startswith(f"▸ Thought for {REASONING_TOKENS}")
        assert all(seg.style.dim for seg in view.thinking.render_line(0) if seg.text.strip())
        assert f"{REASONING_TOKENS} thinking" in str(view.query_one(".meta").render())

        # ctrl+g (in the footer) unfolds it: both parts coloured by provenance.
        assert app.active_bindings["ctrl+g"].binding.description == "Thinking"
        await pilot.press("ctrl+g")
        assert view.thinking.unfolded and view.thinking.rich_text().plain == REASONING
        raw, kinds = written_kinds(events)
        styles = provenance_styles(view.body)
        for widget, part in [(view.thinking, REASONING), (view.body, ANSWER)]:
            at = raw.index(part)
            shown = style_per_char(widget.rich_text())
            assert [s == styles[ACCEPTED] for s in shown] == [
                k == ACCEPTED for k in kinds[at : at + len(part)]
            ]
        assert any(k == ACCEPTED for k in kinds[raw.index(REASONING) :][: len(REASONING)])
        await pilot.press("ctrl+g")
        assert view.thinking.folded

        # Saved with the reasoning apart; the history sent back holds the answer alone.
        saved = app.conversation.messages[-1]
        assert (saved["content"], saved["reasoning"]) == (ANSWER, REASONING)
        reopened = Answer.from_dict(json.loads(app.conversation.path.read_text())["messages"][1])
        assert (reopened.text, reopened.reasoning) == (ANSWER, REASONING)
        await ask(app, pilot, "And again?")
        assert models.calls[-1].messages[1] == {"role": "assistant", "content": ANSWER}

    run_app(models, scenario, model="thinker")


def test_the_thinking_switch_sends_enable_thinking_false_from_the_next_answer(models):
    async def scenario(app, pilot):
        await ask(app, pilot, "Hi")
        await pilot.press("ctrl+s")
        await until(pilot, lambda: isinstance(app.screen, SettingsScreen))
        switch = app.screen.query_one("#thinking", Switch)
        assert switch.value is True
        await pilot.click("#thinking")
        assert switch.value is False
        await pilot.click("#apply")
        await until(pilot, lambda: not isinstance(app.screen, SettingsScreen))
        assert app.thinking is False
        await ask(app, pilot, "Hi")

        on, off = models.calls
        assert on.template_kwargs["enable_thinking"] is True
        assert off.template_kwargs["enable_thinking"] is False
        # The engine got the prompt with the thinking block closed.
        tokenizer = scripted_tokenizer(PIECES, TEMPLATE.read_text())
        closed = encode_chat(tokenizer, Conversation(off.messages), generation_prompt=True)
        assert off.events[-1].record.prompt_tokens == len(closed) + len(CLOSED_BLOCK)

    run_app(models, scenario, model="thinker")


def test_plain_chat_prints_reasoning_dimmed_to_stderr_and_keeps_it_out_of_the_history(models):
    result = CliRunner().invoke(
        main, ["chat", "--plain", "-m", "thinker", "--color"], input="Hi\nAgain\n"
    )
    assert result.exit_code == 0, result.output
    assert "\x1b[2m" in result.stderr and REASONING.strip() in click.unstyle(result.stderr)
    assert "greets" not in result.stdout and "<think>" not in result.stdout
    assert result.stdout.count("Hello") == 2 and "\x1b[32m" in result.stdout
    assert models.calls[1].messages[1] == {"role": "assistant", "content": ANSWER}
    assert f"({REASONING_TOKENS} reasoning)" in result.stderr


def test_generate_streams_the_answer_to_stdout_and_the_reasoning_to_stderr(models):
    result = CliRunner().invoke(main, ["generate", "Hi", "-m", "thinker"])
    assert result.exit_code == 0, result.output
    assert result.stdout == ANSWER + "\n"
    assert REASONING.strip() in result.stderr and "<think>" not in result.stderr
    assert "\x1b[" not in result.stderr  # not a terminal: plain text
    assert f"({REASONING_TOKENS} reasoning)" in result.stderr

    coloured = CliRunner().invoke(main, ["generate", "Hi", "-m", "thinker", "--color"])
    raw, kinds = written_kinds(models.calls[-1].events)
    at = raw.index(REASONING)
    assert ACCEPTED in kinds[at : at + len(REASONING)]  # drafts kept while it reasoned
    assert "\x1b[2m" in coloured.stderr and "\x1b[32m" in coloured.stderr  # dim, green
    assert "\x1b[32m" in coloured.stdout


def test_generate_json_has_the_reasoning_beside_the_answer(models):
    result = CliRunner().invoke(main, ["generate", "Hi", "-m", "thinker", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert (out["text"], out["reasoning"], out["tool_calls"]) == (ANSWER, REASONING, [])
    assert out["record"]["reasoning_tokens"] == REASONING_TOKENS


def test_generate_takes_chat_template_args(models):
    args = ["generate", "Hi", "-m", "thinker", "--json", "--chat-template-args"]
    on = json.loads(CliRunner().invoke(main, args + ['{"enable_thinking": true}']).stdout)
    off = json.loads(CliRunner().invoke(main, args + ['{"enable_thinking": false}']).stdout)
    assert models.calls[-1].template_kwargs == {"enable_thinking": False}
    closed = off["record"]["prompt_tokens"] - on["record"]["prompt_tokens"]
    assert closed == len(CLOSED_BLOCK)
    # The record says whether the model was left its thinking (block drafters trained on
    # plain answers draft worse into a thinking block).
    assert (on["record"]["thinking"], off["record"]["thinking"]) == ("on", "off")


@pytest.mark.parametrize("command", ["generate", "chat"])
@pytest.mark.parametrize(
    "text, says",
    [("{enable_thinking: false}", "not valid JSON"), ("[1]", "must be a JSON object")],
)
def test_bad_chat_template_args_are_one_line_and_no_loading(models, command, text, says):
    args = [command, *(["Hi"] if command == "generate" else ["--plain"])]
    result = CliRunner().invoke(main, [*args, "-m", "thinker", "--chat-template-args", text])
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "--chat-template-args" in lines[0] and says in lines[0]
    assert "Traceback" not in result.output and models.opened == []


def test_text_held_back_for_a_marker_keeps_the_provenance_of_the_event_that_wrote_it():
    tokenizer = scripted_tokenizer(PIECES, TEMPLATE.read_text())
    reader = PieceReader(tokenizer, Conversation([{"role": "user", "content": "Hi"}]))
    first = reader.read(Accepted((1,), "<think>so <"))  # "<" may start "</think>"
    assert first.pieces == (Piece("so ", Accepted, True),) and first.reasoning
    second = reader.read(Corrected((2,), "b> ok</think>\n\nYes"))
    assert second.pieces == (
        Piece("<", Accepted, True),
        Piece("b> ok", Corrected, True),
        Piece("Yes", Corrected, False),
    )
