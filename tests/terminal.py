"""A command in a real terminal (a detached tmux session), for tests of `mlxspec chat`.

Outside CI a missing tmux skips those tests; in CI (the CI variable set) they fail, so
that a CI run can never pass without having driven the real terminal once.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable

import pytest

IN_CI = bool(os.environ.get("CI"))
needs_tmux = pytest.mark.skipif(
    shutil.which("tmux") is None and not IN_CI, reason="needs tmux (.ci/run installs it)"
)


class Terminal:
    """`with Terminal(command) as term:` runs `command` (a shell line) in a 120x34 tmux
    pane; the tmux server is killed on the way out, whatever happened."""

    def __init__(self, command: str, width: int = 120, height: int = 34):
        if shutil.which("tmux") is None:
            pytest.fail("CI is set but tmux is missing (.ci/run could not install it): install it")
        self.socket = f"mlxspec-test-{os.getpid()}-{id(self)}"
        self.command, self.size = command, (str(width), str(height))

    def __enter__(self) -> Terminal:
        width, height = self.size
        self.tmux("new-session", "-d", "-s", "term", "-x", width, "-y", height, self.command)
        return self

    def __exit__(self, *exc) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True)

    def tmux(self, *args: str) -> str:
        # Without COLUMNS/LINES (pytest may set them): Textual would size itself by them.
        env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
        return subprocess.run(
            ["tmux", "-L", self.socket, *args], capture_output=True, text=True, check=True, env=env
        ).stdout

    def screen(self, colours: bool = False) -> str:
        """What the pane shows now (`colours`: with its ANSI escapes)."""
        return self.tmux("capture-pane", "-t", "term", "-p", *(["-e"] if colours else []))

    def send(self, *keys: str) -> None:
        """tmux key names or text, e.g. send("hello", "Enter"), send("C-q")."""
        self.tmux("send-keys", "-t", "term", *keys)

    def wait_for(self, shown: Callable[[str], bool], seconds: float, colours=False) -> str:
        """The screen once `shown(screen)` holds, or the last screen after `seconds`."""
        deadline = time.monotonic() + seconds
        while True:
            screen = self.screen(colours)
            if shown(screen) or time.monotonic() > deadline:
                return screen
            time.sleep(0.5)

    def pane_pid(self) -> int:
        """The shell's pid: the command's processes are its descendants."""
        return int(self.tmux("display-message", "-p", "-t", "term", "#{pane_pid}").strip())
