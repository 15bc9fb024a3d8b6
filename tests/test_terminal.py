"""`mlxspec chat` in a real terminal (tmux): provenance colours and live stats on screen."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

# Outside CI a missing tmux skips this test; in CI (the CI variable set) it fails, so that
# a CI run can never pass without having driven the real terminal once.
IN_CI = bool(os.environ.get("CI"))
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("tmux") is None and not IN_CI, reason="needs tmux (.ci/run installs it)"
    ),
]

PROMPT = "Repeat this list exactly: apples, pears, plums, figs, dates, limes, kiwis."
COLOUR = re.compile(r"\x1b\[38;5;(\d+)m")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def colour_before(line: str, text: str) -> str:
    """The 256-colour foreground in force where `text` starts on a captured line."""
    codes = COLOUR.findall(line[: line.index(text)])
    return codes[-1]


def test_chat_in_tmux_colours_accepted_drafts_and_shows_stats(tmp_path, smollm2):
    if shutil.which("tmux") is None:
        pytest.fail("CI is set but tmux is missing (.ci/run could not install it): install it")
    socket = f"mlxspec-test-{os.getpid()}"
    mlxspec = str(Path(sys.executable).with_name("mlxspec"))
    env = f"MLXSPEC_DATA={tmp_path} TERM=xterm-256color"

    def tmux(*args: str) -> str:
        return subprocess.run(
            ["tmux", "-L", socket, *args], capture_output=True, text=True, check=True
        ).stdout

    tmux("new-session", "-d", "-s", "chat", "-x", "120", "-y", "34", f"{env} {mlxspec} chat")
    try:
        screen = ""
        for _ in range(120):  # the model loads, then the prompt box takes input
            time.sleep(0.5)
            screen = tmux("capture-pane", "-t", "chat", "-p")
            if "greedy" in screen:
                break
        tmux("send-keys", "-t", "chat", PROMPT, "Enter")
        for _ in range(240):
            time.sleep(0.5)
            screen = tmux("capture-pane", "-t", "chat", "-p", "-e")
            if re.search(r"\d+ tokens, [\d.]+ tok/s", screen):
                break
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
        tmux("send-keys", "-t", "chat", "C-q")
    finally:
        subprocess.run(["tmux", "-L", socket, "kill-server"], capture_output=True)
