"""The one wrapper every command body runs in: errors users can cause become one line.

It sits below the commands (and inside `distributed_options`, so a launched rank reports
the same line), not in the package's `__init__`, which imports the commands.
"""

from __future__ import annotations

import functools

import click

from mlxspec.registry.models_toml import RegistryError


def user_errors() -> tuple[type[Exception], ...]:
    """The errors a user can cause, imported when one is being matched: the modules that
    raise them load mlx-lm (and transformers), which a command's launcher, `--help` and
    a usage error never need."""
    from mlxspec.decoding.engine import GenerationError
    from mlxspec.models.loading import LoadError
    from mlxspec.models.packaged import PullError
    from mlxspec.registry.runtime import ProposerError

    return RegistryError, LoadError, PullError, ProposerError, GenerationError


def fail_cleanly(func):
    """Turn the errors users can cause into one clear line (no traceback)."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except KeyboardInterrupt:
            raise click.ClickException("interrupted") from None
        except user_errors() as err:  # evaluated only while an error is being matched
            raise click.ClickException(str(err)) from None

    return wrapper
