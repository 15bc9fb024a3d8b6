"""Every command's options and `--help` page match a recorded copy (tests/data/cli_options.json).

The record guards refactors of `mlxspec.cli`: an option dropped, renamed, retyped or
re-defaulted, or a help text changed, fails here. After a deliberate change, rewrite the
record with `python tests/test_cli_options.py` and review its diff.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import click
import pytest

from mlxspec.cli import main

RECORD = Path(__file__).parent / "data" / "cli_options.json"
# Help pages as click draws them in an 80-column terminal: 78 wide, 2 columns kept spare.
TERMINAL_COLUMNS = 80
HELP_WIDTH = TERMINAL_COLUMNS - 2
# Read at import to name one test per command; missing, test_the_same_commands says so.
RECORDED = json.loads(RECORD.read_text()) if RECORD.exists() else {}


def command_contexts() -> dict[str, click.Context]:
    """A context for the group and one for each command, keyed by the command line."""
    top = main.make_context("mlxspec", [], resilient_parsing=True, terminal_width=HELP_WIDTH)
    contexts = {"mlxspec": top}
    for name in main.list_commands(top):
        command = main.get_command(top, name)
        contexts[f"mlxspec {name}"] = command.make_context(
            name, [], parent=top, resilient_parsing=True
        )
    return contexts


def describe(ctx: click.Context) -> dict:
    """What a user sees of one command: its help, each parameter, and the rendered page."""
    command = ctx.command
    params = []
    for param in command.get_params(ctx):
        info = param.to_info_dict()
        info["show_default"] = getattr(param, "show_default", None)
        params.append(info)
    return {
        "help": inspect.cleandoc(command.help or ""),
        # JSON round trip: tuples become lists, as they are read back from the record.
        "params": json.loads(json.dumps(params, default=repr)),
        "help_page": command.get_help(ctx).splitlines(),
    }


def live_cli() -> dict[str, dict]:
    return {line: describe(ctx) for line, ctx in command_contexts().items()}


@pytest.fixture(scope="module")
def live():
    return live_cli()


def test_the_same_commands(live):
    assert RECORDED, f"no record at {RECORD}: run python {__file__}"
    assert sorted(live) == sorted(RECORDED)


@pytest.mark.parametrize("line", sorted(RECORDED))
def test_every_option_as_recorded(live, line):
    want, got = RECORDED[line], live.get(line)
    assert got is not None, f"`{line}` is gone"
    want_names = [p["name"] for p in want["params"]]
    got_names = [p["name"] for p in got["params"]]
    assert got_names == want_names, f"`{line}`: options differ"
    for want_param, got_param in zip(want["params"], got["params"]):
        assert got_param == want_param, f"`{line}` {want_param['opts']} changed"
    assert got["help"] == want["help"], f"`{line}`: help text changed"
    assert got["help_page"] == want["help_page"], f"`{line} --help` changed"


def test_python_dash_m_and_the_entry_point_run_the_same_group():
    """`python -m mlxspec` (how mlx.launch starts ranks) and the `mlxspec` script."""
    (script,) = entry_points(group="console_scripts", name="mlxspec")
    assert script.load() is main
    env = {**os.environ, "COLUMNS": str(TERMINAL_COLUMNS)}
    shown = subprocess.run(
        [sys.executable, "-m", "mlxspec", "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    )
    usage, *page = shown.stdout.splitlines()
    assert usage == "Usage: python -m mlxspec [OPTIONS] COMMAND [ARGS]..."
    assert page == RECORDED["mlxspec"]["help_page"][1:]


if __name__ == "__main__":
    RECORD.parent.mkdir(exist_ok=True)
    RECORD.write_text(json.dumps(live_cli(), indent=1) + "\n")
    print(f"wrote {RECORD}")
