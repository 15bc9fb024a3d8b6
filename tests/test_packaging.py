"""The shipped registry lives at the repository root, yet an installed wheel must find it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import mlxspec
from mlxspec.registry.models_toml import SHIPPED_FILE

ROOT = Path(mlxspec.__file__).parent.parent
# What a wheel is built from (setup.py's build step reads the root models.toml).
SOURCES = ["pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "models.toml"]


def test_a_checkout_reads_the_one_registry_at_the_root():
    assert SHIPPED_FILE == ROOT / "models.toml"
    assert not (ROOT / "mlxspec" / "models.toml").exists()  # a stale copy would shadow it


def test_an_installed_wheel_carries_the_registry_and_resolves_its_heads(tmp_path):
    source = tmp_path / "src"  # a copy, so building leaves no build/ in the checkout
    source.mkdir()
    for name in SOURCES:
        shutil.copy2(ROOT / name, source / name)
    for package in ("mlxspec", "tui"):
        shutil.copytree(ROOT / package, source / package, ignore=_pycache)
    # Built as pip builds it for `pip install .`: isolated, with the declared setuptools.
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path)]
    subprocess.run([*build, str(source)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("mlxspec-*.whl")
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    assert (site / "mlxspec" / "models.toml").read_bytes() == (ROOT / "models.toml").read_bytes()
    folder = ROOT / "mlxspec" / "drafter" / "answers"  # the suffix seed, drafter data
    answers = sorted(p for p in folder.iterdir() if not p.name.startswith("."))
    assert {p.suffix for p in answers} == {".npz", ".json"}
    for path in answers:
        shipped = site / path.relative_to(ROOT)
        assert shipped.read_bytes() == path.read_bytes(), shipped

    probe = (
        "import json; from mlxspec.registry.models_toml import SHIPPED_FILE, load_registry; "
        "entry = load_registry().get(None); "
        "print(json.dumps([str(SHIPPED_FILE), entry.proposer('head').options['path']]))"
    )
    env = {k: v for k, v in os.environ.items() if k != "MLXSPEC_MODELS"}
    env |= {"PYTHONPATH": str(site), "XDG_CONFIG_HOME": str(tmp_path / "config")}
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=env, check=True, capture_output=True
    )
    shipped, head = map(Path, json.loads(out.stdout))
    assert shipped == site / "mlxspec" / "models.toml"
    assert head == site / "mlxspec" / "heads" / "smollm2-135m" and (head / "head.json").is_file()


def _pycache(folder: str, names: list[str]) -> list[str]:
    return [name for name in names if name == "__pycache__"]
