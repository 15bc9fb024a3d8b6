"""The --ranks/--hostfile/--backend/--parallel options of generate, chat and serve.

Without them a command runs as before. With them, the command re-runs itself once per
rank: as children of this process on the ring backend (see `ranks`), under mlx.launch
on the others (see `launch`); inside a launched rank, the command body runs with a rank
session started (see `rank.current_rank`), and every way out reports an exit marker.
`chat` on the ring backend (`--ranks N`, or `--hostfile H` over ssh) is the exception:
rank 0 stays in this process, on the user's terminal, and starts the other ranks itself
(see `followers`).
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from typing import NoReturn

import click

from mlxspec.console import say
from mlxspec.distributed.config import BACKENDS, PARALLEL_MODES, RankConfig
from mlxspec.distributed.errors import DistributedError
from mlxspec.distributed.launch import LOST, STOP_SECONDS

DEFAULT_TIMEOUT = 120.0
LEAVE_SECONDS = 5.0  # a front end told the ranks are lost has this long to end the process

OPTIONS = [
    click.option(
        "--ranks",
        type=click.IntRange(min=2),  # one rank is no sharding (and MLX's ring cannot run it)
        help="Shard the target over N >= 2 local processes (ring backend over loopback).",
    ),
    click.option(
        "--hostfile",
        type=click.Path(dir_okay=False),
        help="Shard the target over the hosts of an mlx.launch hostfile (JSON).",
    ),
    click.option(
        "--backend",
        type=click.Choice(BACKENDS),
        help="MLX distributed backend (default: the hostfile's, else ring).",
    ),
    click.option(
        "--parallel",
        type=click.Choice(PARALLEL_MODES),
        default="tensor",
        show_default=True,
        help="How to split the target across ranks.",
    ),
    click.option(
        "--collective-timeout",
        type=click.FloatRange(min=1),
        default=DEFAULT_TIMEOUT,
        show_default=True,
        help="Seconds a rank may wait on the others before every rank stops.",
    ),
]


def distributed_options(func):
    """Add the options to a click command and run it sharded when they ask for it."""

    @functools.wraps(func)
    def wrapper(*args, ranks, hostfile, backend, parallel, collective_timeout, **kwargs):
        config = RankConfig.from_env()
        if config is not None:
            return _run_rank(config, func, args, kwargs)
        if not (ranks or hostfile):
            if backend:
                raise click.UsageError("--backend needs --ranks or --hostfile")
            return func(*args, **kwargs)
        if ranks and hostfile:
            raise click.UsageError("give --ranks or --hostfile, not both")
        from mlxspec.distributed.launch import LaunchRequest, read_hostfile, run_launched

        try:
            hosts = read_hostfile(hostfile) if hostfile else []
        except DistributedError as err:
            raise click.ClickException(str(err)) from None
        request = LaunchRequest(
            ranks,
            hostfile,
            backend or _hostfile_backend(hostfile),
            parallel,
            collective_timeout,
            hosts,
            STOP_SECONDS + (kwargs.get("shutdown_timeout") or 0),  # serve's own bound first
        )
        argv = sys.argv[1:]
        stdin = None
        if kwargs.get("prompt") == "-":  # read here: the ranks get it on their command line
            argv = [sys.stdin.read() if a == "-" else a for a in argv]
        elif func.__name__ == "chat":
            if request.backend == "ring":  # rank 0 keeps the terminal
                _run_front(request, _rank_argv(argv), func, args, kwargs)
            if sys.stdin.isatty() and not kwargs.get("plain"):
                say(
                    f"--backend {request.backend}: the line chat (mlx.launch gives rank 0 "
                    "pipes; the TUI needs the ring backend)"
                )
            stdin = sys.stdin  # rank 0 reads the turns (mlx.launch relays stdin)
        from mlxspec.distributed.ranks import run_ranks  # ring: no mlx.launch (its relay spins)

        run = run_ranks if request.backend == "ring" else run_launched
        sys.exit(run(request, _rank_argv(argv), stdin))

    for option in reversed(OPTIONS):
        wrapper = option(wrapper)
    return wrapper


def _rank_argv(argv: list[str]) -> list[str]:
    from mlxspec.distributed.launch import strip_launch_options

    return strip_launch_options(argv)


def _hostfile_backend(hostfile: str | None) -> str:
    if hostfile:
        import json
        from pathlib import Path

        try:
            data = json.loads(Path(hostfile).expanduser().read_text())
        except (OSError, ValueError):
            return "ring"
        if isinstance(data, dict) and data.get("backend") in BACKENDS:
            return data["backend"]
    return "ring"


def _run_rank(config, func, args, kwargs) -> NoReturn:
    """The command body inside one rank: a clear line and a marker on every way out; a
    rank whose launcher (or, over ssh, its connection) is gone ends too."""
    from mlxspec.distributed.rank import report_exit, report_front, start_session
    from mlxspec.processes import exit_with_parent

    exit_with_parent()
    code, session = 1, None
    try:
        session = start_session(config)
        report_front(session)
        func(*args, **kwargs)
        code = 0
    except click.exceptions.Exit as stop:
        code = stop.exit_code
    except click.ClickException as err:
        code = err.exit_code
        _error(session, err.format_message())
    except (DistributedError, RuntimeError, ValueError, OSError) as err:
        _error(session, _explain(err))
    finally:
        report_exit(code)
    _leave(code)


def _leave(code: int) -> NoReturn:
    """End a rank at once: its work is done and reported, and Python's own teardown (MLX's
    ring, the model's arrays) takes seconds (measured: 8 s for 3 ranks on 2 cores) that a
    stopping server's ranks must not hold its port and the machine for."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # the launcher is gone
            pass
    os._exit(code)


def _run_front(request, rank_argv: list[str], func, args, kwargs) -> NoReturn:
    """`chat` on the ring backend: the command body as rank 0 in this process, on the
    user's terminal, with the other ranks as its children (see `followers`). A stop
    signal ends them too (`_stop_front`)."""
    from mlxspec.distributed.followers import Followers
    from mlxspec.processes import stop_signals

    followers = Followers(request, rank_argv)
    with stop_signals(functools.partial(_stop_front, followers)):
        code = followers.finish(*_front(followers, func, args, kwargs))
    if code:
        sys.stdout.flush()
        os._exit(code)  # not sys.exit: a thread may still wait in a collective
    sys.exit(0)


def _front(followers, func, args, kwargs) -> tuple[int, str | None]:
    """Rank 0's command body: its exit code, and the error to report."""
    from mlxspec.distributed.followers import hide_collective_noise
    from mlxspec.distributed.rank import start_session

    try:
        hide_collective_noise()
        followers.start()
        session = start_session(followers.config)
        session.watchdog.on_timeout = followers.fail
        session.on_joined.append(followers.forget_ring)
        followers.on_lost = functools.partial(_lost, session, followers)
        func(*args, **kwargs)
        return 0, None
    except click.exceptions.Exit as stop:
        return stop.exit_code, None
    except click.ClickException as err:
        return err.exit_code, err.format_message()
    except (DistributedError, RuntimeError, ValueError, OSError) as err:
        return 1, _explain(err)
    except KeyboardInterrupt:
        return 1, "interrupted"


def _stop_front(followers, signum: int) -> None:
    """A stop signal to `chat`'s rank 0: the other ranks are stopped and the chat ends as
    when they are lost (the TUI leaves the screen first), on a thread, since the main
    thread may be inside a collective that their end interrupts."""
    from mlxspec.processes import stop_reason

    stop = threading.Thread(target=followers.fail, args=(stop_reason(signum),), daemon=True)
    stop.start()


def _lost(session, followers, reason: str) -> None:
    """The ranks `_run_front` started are lost: the front end leaves first if it has a
    way to (the TUI restores the terminal), but a thread of this process still waiting in
    a collective must not keep it alive."""
    if session.on_lost is None:
        followers.abort(reason)
    session.on_lost(reason)
    timer = threading.Timer(LEAVE_SECONDS, followers.abort, (reason,))
    timer.daemon = True
    timer.start()


def _explain(err: Exception) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if "[ring]" in text or "[jaccl]" in text or "connection" in text:
        return f"{LOST} ({text}); every rank stopped"
    return text


def _error(session, message: str) -> None:
    who = "" if session is None or session.front else f"rank {session.rank}: "
    sys.stderr.write(f"Error: {who}{message}\n")
    sys.stderr.flush()
