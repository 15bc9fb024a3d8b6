"""Build step: ship the registry inside the package.

The shipped registry is `models.toml` at the repository root (one file, next to
pyproject.toml). An installed package has no repository root, so the build copies it into
the package, where `mlxspec.registry.models_toml` looks first. An editable install reads
the root file.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

REGISTRY = "models.toml"


class BuildWithRegistry(build_py):
    """build_py plus a copy of the root models.toml into the built package."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return  # the package runs from the checkout and finds the root file
        self.copy_file(REGISTRY, str(Path(self.build_lib) / "mlxspec" / REGISTRY))


setup(cmdclass={"build_py": BuildWithRegistry})
