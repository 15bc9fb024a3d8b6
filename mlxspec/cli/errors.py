"""The one wrapper every command body runs in: errors users can cause become one line.

It sits below the commands (and inside `distributed_options`, so a launched rank reports
the same line), not in the package's `__init__`, which imports the commands.
"""

from __future__ import annotations

import functools

import click

from mlxspec.registry import RegistryError


def fail_cleanly(func):
    """Turn the errors users can cause into one clear line (no traceback)."""
    from mlxspec.engine import GenerationError
    from mlxspec.loading import LoadError
    from mlxspec.pull import PullError
    from mlxspec.runtime import ProposerError

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except (RegistryError, LoadError, PullError, ProposerError, GenerationError) as err:
            raise click.ClickException(str(err)) from None
        except KeyboardInterrupt:
            raise click.ClickException("interrupted") from None

    return wrapper
