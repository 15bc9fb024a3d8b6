"""`mlxspec chat` in a real terminal (tmux): provenance colours and live stats on screen."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from terminal import Terminal, needs_tmux

pytestmark = [pytest.mark.slow, needs_tmux]

PROMPT = "Repeat this list exactly: apples, pears, plums, figs, dates, limes, kiwis."
COLOUR = re.compile(r"\x1b\[38;5;(\d+)m")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def colour_before(line: str, text: str) -> str:
    """The 256-colour foreground in force where `text` starts on a captured line."""
    codes = COLOUR.findall(line[: line.index(text)])
    return codes[-1]


def test_chat_in_tmux_colours_accepted_drafts_and_shows_stats(tmp_path, smollm2):
    mlxspec = str(Path(sys.executable).with_name("mlxspec"))
    env = f"MLXSPEC_DATA={tmp_path} TERM=xterm-256color"
    with Terminal(f"{env} {mlxspec} chat") as term:
        term.wait_for(lambda screen: "greedy" in screen, 60)  # loaded; the prompt box takes input
        term.send(PROMPT, "Enter")
        screen = term.wait_for(
            lambda screen: re.search(r"\d+ tokens, [\d.]+ tok/s", screen), 120, colours=True
        )
        lines = screen.splitlines()
        legend = next(line for line in lines if "accepted draft" in line)
        accepted, own = (
            colour_before(legend, "accepted draft"),
            colour_before(legend, "target's own"),
        )
        assert accepted != own
        plain = [ANSI.sub("", line) for line in lines]
        # The answer sits between its label line (the model's name) and its stats line.
        label = max(i for i, text in enumerate(plain) if text.strip(" █▊▎▍▌▋") == "smollm2-135m")
        stats = next(i for i, text in enumerate(plain) if re.search(r"\d+ tokens, ", text))
        answer = "\n".join(lines[label + 1 : stats])
        # Colour codes may split a word where a draft ends ("k" own, "iwis" accepted).
        assert "kiwis" in ANSI.sub("", answer), screen
        used = set(COLOUR.findall(answer))
        assert {accepted, own} <= used, f"answer colours {used}, legend {accepted}/{own}"
        assert re.search(r"accepted \d+%", screen) and "tok/s" in screen
        term.send("C-q")
